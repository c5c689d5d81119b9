//! `examples/mlp.py`, a Python host (ctypes and numpy, no PyTorch) that computes an
//! MLP with numpy, trains under `fsdp launch --nproc-per-node 2` (processes, the tcp
//! backend, the torchrun environment) like it does at world size 1, and like mlp.c's C
//! host. Skipped with a notice when numpy is missing, unless `FSDP_REQUIRE_NUMPY` is set
//! (CI sets it), where that is a failure.
//!
//! The launcher is the library's `elastic_launch`, which is all `fsdp launch` runs (the
//! `fsdp` binary belongs to another package of the workspace, which a test here cannot
//! build), in a child process of its own: this test binary run again on
//! [`launch_child_entry`], so the launcher's signal handling and exit stay out of the test
//! process.

use super::common::assert_close;
use fsdp::distributed::{elastic_launch, ElasticLaunchConfig};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::process::Command;

/// Child-process entry: `fsdp launch --nproc-per-node $FSDP_TEST_LAUNCH_NPROC -- python3
/// examples/mlp.py --lib libfsdp_capi.so`, with the ranks' stdout in the file
/// `FSDP_TEST_LAUNCH_OUT`; exits with the launcher's status. A no-op in a normal test run.
#[test]
fn launch_child_entry() {
    let (Ok(nproc), Some(out)) = (
        std::env::var("FSDP_TEST_LAUNCH_NPROC"),
        std::env::var_os("FSDP_TEST_LAUNCH_OUT"),
    ) else {
        return;
    };
    let file = std::fs::File::create(&out).unwrap();
    // The ranks inherit this process's stdout: point it at the file, away from the test
    // harness's own lines.
    // SAFETY: dup2 of a valid open descriptor onto 1; nothing else in this process writes
    // to fd 1 concurrently (the child entry runs alone).
    assert!(unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&file), 1) } >= 0);
    let cfg = ElasticLaunchConfig {
        nproc_per_node: nproc.parse().unwrap(),
        ..Default::default()
    };
    let args: Vec<OsString> = vec![
        format!("{}/examples/mlp.py", env!("CARGO_MANIFEST_DIR")).into(),
        "--lib".into(),
        super::lib_dir().join("libfsdp_capi.so").into(),
    ];
    let code = match elastic_launch(&cfg, "python3".as_ref(), &args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn numpy_available() -> bool {
    Command::new("python3")
        .args(["-c", "import numpy"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Rank 0's `param NAME values...` and `loss STEP value` lines.
fn train(nproc: usize) -> (BTreeMap<String, Vec<f32>>, Vec<f32>) {
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("mlp-py-{}-{nproc}.out", std::process::id()));
    super::run(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "python_host::launch_child_entry",
                "--test-threads",
                "1",
            ])
            .env("FSDP_TEST_LAUNCH_NPROC", nproc.to_string())
            .env("FSDP_TEST_LAUNCH_OUT", &file),
    );
    let out = std::fs::read_to_string(&file).unwrap();
    let _ = std::fs::remove_file(&file);
    println!("mlp.py under fsdp launch --nproc-per-node {nproc}:\n{out}");
    let (mut params, mut losses) = (BTreeMap::new(), Vec::new());
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f[0] {
            "param" => {
                params.insert(
                    f[1].to_string(),
                    f[2..].iter().map(|v| v.parse().unwrap()).collect(),
                );
            }
            "loss" => losses.push(f[2].parse().unwrap()),
            _ => panic!("unexpected line: {line}"),
        }
    }
    (params, losses)
}

#[test]
fn a_python_numpy_host_under_fsdp_launch_trains_like_world_size_one() {
    if !numpy_available() {
        let msg = "numpy is not installed for python3 (python3 -m pip install numpy)";
        if std::env::var_os("FSDP_REQUIRE_NUMPY").is_some() {
            panic!("{msg}; FSDP_REQUIRE_NUMPY is set (CI), so this is a failure");
        }
        eprintln!("SKIPPED the Python host test: {msg}");
        return;
    }
    let (one, one_losses) = train(1);
    let (two, two_losses) = train(2);
    assert_eq!(
        one.keys().collect::<Vec<_>>(),
        ["0.bias", "0.weight", "2.bias", "2.weight"]
    );
    assert_eq!(one_losses.len(), 5);
    for (name, want) in &one {
        // Another split of the batch: another summation order, f32 rounding.
        assert_close(&format!("world 2 {name}"), &two[name], want, 1e-7, 1e-6);
    }
    assert_close("world 2 losses", &two_losses, &one_losses, 1e-7, 1e-6);
    assert!(one_losses[4] < one_losses[0], "{one_losses:?}");
    // The same numbers as the C host's (mlp.c, world 1, computed in loops).
    let c = super::run(Command::new(super::compile_c("examples/mlp.c")).args(["--worlds", "1"]));
    for line in c.lines().filter(|l| l.starts_with("param")) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let v: Vec<f32> = f[3..].iter().map(|v| v.parse().unwrap()).collect();
        assert_close(&format!("C vs Python {}", f[2]), &v, &one[f[2]], 1e-7, 1e-6);
    }
}
