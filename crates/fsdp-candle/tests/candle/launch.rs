//! The example under `elastic_launch` (what `fsdp launch` runs: one process per rank,
//! meeting over TCP) trains exactly as its `train` function on thread ranks.

#[allow(dead_code)]
#[path = "../../examples/train_mlp.rs"]
mod example;

use crate::models::values;
use candle::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use fsdp::distributed::{elastic_launch, launch, ElasticLaunchConfig, LaunchOptions};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The example binary `cargo test` built next to this test binary
/// (`target/<profile>/examples/<name>`; this one is in `target/<profile>/deps/`).
///
/// # Panics
/// When it is missing or older than its sources, saying how to build it: a `cargo test`
/// filtered to one test target (`--test candle`) does not build examples.
fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/");
    let path = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let build = format!("cargo build -p fsdp-candle --example {name} (a plain `cargo test` builds it; `--test candle` alone does not)");
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} is missing: {build}", path.display()));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources = vec![root.join(format!("examples/{name}.rs"))];
    for e in std::fs::read_dir(root.join("src")).expect("the crate's src/") {
        sources.push(e.expect("a src/ entry").path());
    }
    for s in sources {
        let changed = std::fs::metadata(&s)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        assert!(
            changed <= built,
            "{} is older than {}: {build}",
            path.display(),
            s.display()
        );
    }
    path
}

#[test]
fn the_example_under_elastic_launch_equals_thread_ranks() {
    let exe = example_binary("train_mlp");
    let dir = std::env::temp_dir().join(format!("fsdp-candle-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Initial values both runs start from (processes cannot share candle's random draw).
    let init = dir.join("init.safetensors");
    let vm = VarMap::new();
    example::Mlp::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
    vm.save(&init).unwrap();
    let out = dir.join("out");
    let args: Vec<String> = ["--steps", "8", "--strategy", "full-shard"]
        .into_iter()
        .map(String::from)
        .chain(["--init".into(), init.display().to_string()])
        .chain(["--out".into(), out.display().to_string()])
        .collect();
    let cfg = ElasticLaunchConfig {
        nproc_per_node: 2,
        ..ElasticLaunchConfig::default()
    };
    let os_args: Vec<OsString> = args.iter().map(OsString::from).collect();
    elastic_launch(&cfg, exe.as_os_str(), &os_args).unwrap();
    let losses: Vec<f32> = std::fs::read_to_string(out.join("losses.txt"))
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    let mut params = VarMap::new();
    example::Mlp::new(VarBuilder::from_varmap(&params, DType::F32, &Device::Cpu)).unwrap();
    params.load(out.join("params.safetensors")).unwrap();

    let parsed = example::Args::parse(args.into_iter()).unwrap();
    let threads = launch(&LaunchOptions::new(2), |pg| {
        let (l, vm) = example::train(pg, &parsed)?;
        Ok((l, values(&vm)))
    })
    .unwrap();
    let (want_l, want_p) = &threads[0];
    assert_eq!(losses.len(), 8);
    assert_eq!(&losses, want_l, "losses: processes against threads");
    assert_eq!(
        &values(&params),
        want_p,
        "parameters: processes against threads"
    );
    assert!(
        losses[7] < losses[0],
        "the example's loss did not go down: {losses:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
