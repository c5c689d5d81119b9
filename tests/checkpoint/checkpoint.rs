//! Checkpoint files: a process killed in the middle of a save leaves the previous
//! checkpoint loadable (resuming: tests/train/resume.rs; `fsdp train` killed during a save and
//! the checkpoint options of the command line: crates/fsdp-cli/tests/cli/checkpoint.rs);
//! truncated, corrupted and mismatched checkpoints are refused naming the file or the
//! parameter, before anything is modified.

use crate::common;

use common::kill_mid_save;
use fsdp::checkpoint::{
    load_checkpoint, load_state_dict_file, read_index, save_checkpoint, save_state_dict_file,
};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullStateDict, FullStateDictConfig,
    FullyShardedDataParallel, ShardingStrategy, StateDict, StateDictConfig, StateDictType,
};
use fsdp::nn::{GptConfig, GPT};
use fsdp::optim::{AdamConfig, AdamW, Optimizer};
use fsdp::tensor::{DType, Tensor};
use std::path::{Path, PathBuf};
use std::process::Command;

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn small_gpt(n_layer: usize, n_embd: usize) -> Box<dyn fsdp::nn::Module> {
    let cfg = GptConfig {
        vocab_size: 29,
        block_size: 6,
        n_layer,
        n_head: 2,
        n_embd,
    };
    Box::new(GPT::new(cfg, 5).unwrap())
}

fn wrapped(pg: Group, n_layer: usize, n_embd: usize) -> fsdp::Result<FullyShardedDataParallel> {
    let cfg = FsdpConfig {
        auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
        ..Default::default()
    };
    FullyShardedDataParallel::new(small_gpt(n_layer, n_embd), pg, cfg)
}

fn full_sd(m: &mut FullyShardedDataParallel) -> FullStateDict {
    match m
        .state_dict(StateDictConfig::Full(FullStateDictConfig::default()))
        .unwrap()
    {
        StateDict::Full(f) => f,
        _ => unreachable!(),
    }
}

fn same(a: &FullStateDict, b: &FullStateDict) -> bool {
    a.tensors.len() == b.tensors.len()
        && a.tensors
            .iter()
            .zip(&b.tensors)
            .all(|((n, x), (m, y))| n == m && x.to_vec_f32().unwrap() == y.to_vec_f32().unwrap())
}

/// Saves a checkpoint of the (2 layer, width 8) GPT at world size 2 into `dir`.
fn save_small(dir: &Path, ty: StateDictType, n_layer: usize, n_embd: usize) {
    launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = wrapped(pg, n_layer, n_embd)?;
        let opt = AdamW::new(AdamConfig::adamw());
        save_checkpoint(
            dir,
            &mut m,
            Some(&opt as &dyn Optimizer),
            ty,
            serde_json::json!({"step": 0}),
        )
    })
    .unwrap();
}

/// Loads `dir` at world size 2 into the (2, 8) GPT, checks nothing changed, returns the
/// first rank's error.
fn load_err(dir: &Path) -> String {
    let errs = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = wrapped(pg, 2, 8)?;
        let before = full_sd(&mut m);
        let mut opt = AdamW::new(AdamConfig::adamw());
        let e = load_checkpoint(dir, &mut m, Some(&mut opt as &mut dyn Optimizer))
            .err()
            .map(|e| e.to_string());
        assert!(
            same(&full_sd(&mut m), &before),
            "a refused load modified the model"
        );
        Ok(e)
    })
    .unwrap();
    errs.into_iter()
        .flatten()
        .find(|e| !e.contains("could not load its part"))
        .expect("the load was refused")
}

fn rank_file(dir: &Path, rank: usize) -> PathBuf {
    let idx = read_index(dir).unwrap();
    let f = idx
        .files
        .iter()
        .find(|f| f.name.starts_with(&format!("rank-{rank:05}")))
        .unwrap();
    dir.join(&f.name)
}

#[test]
fn truncated_corrupted_and_mismatched_checkpoints_are_refused_before_any_change() {
    // Truncated data file: named, with its size against the index's.
    let d = tmp_dir("truncated");
    save_small(&d, StateDictType::Sharded, 2, 8);
    let f = rank_file(&d, 1);
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let e = load_err(&d);
    assert!(
        e.contains(&f.display().to_string()) && e.contains("truncated"),
        "{e}"
    );

    // Corrupted data file: one flipped byte near the end (tensor data).
    let d = tmp_dir("corrupted");
    save_small(&d, StateDictType::Sharded, 2, 8);
    let f = rank_file(&d, 0);
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 0x40;
    std::fs::write(&f, &bytes).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains(&f.display().to_string()) && e.contains("corrupted"),
        "{e}"
    );

    // Truncated index: a save that never finished reads as no checkpoint.
    let d = tmp_dir("index");
    save_small(&d, StateDictType::Full, 2, 8);
    let idx = d.join("index.json");
    let text = std::fs::read(&idx).unwrap();
    std::fs::write(&idx, &text[..text.len() / 2]).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("index.json") && e.contains("corrupted or truncated"),
        "{e}"
    );

    // An index naming a file outside its directory: refused before opening it.
    let d = tmp_dir("escape");
    save_small(&d, StateDictType::Full, 2, 8);
    let idx = d.join("index.json");
    // (The index's own checksums recomputed: the file name itself must be refused.)
    let mut index = read_index(&d).unwrap();
    let name = index.files[0].name.clone();
    for f in &mut index.files {
        if f.name == name {
            f.name = "../../../../etc/passwd".into();
        }
    }
    std::fs::write(&idx, fsdp::checkpoint::index_text(&index).unwrap()).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("'../../../../etc/passwd'") && e.contains("not a plain file name"),
        "{e}"
    );

    // Wrong shapes (a wider model), unexpected and missing keys (more or fewer layers):
    // each named with what was expected.
    let d = tmp_dir("wider");
    save_small(&d, StateDictType::Sharded, 2, 12);
    let e = load_err(&d);
    assert!(
        e.contains("'wte.weight': expected shape [29, 8], got [29, 12]"),
        "{e}"
    );
    let d = tmp_dir("deeper");
    save_small(&d, StateDictType::Full, 3, 8);
    let e = load_err(&d);
    assert!(
        e.contains("unexpected key(s)") && e.contains("'blocks.2.attn.c_attn.weight'"),
        "{e}"
    );
    let d = tmp_dir("shallower");
    save_small(&d, StateDictType::Sharded, 1, 8);
    let e = load_err(&d);
    assert!(
        e.contains("missing key(s)")
            && e.contains("'blocks.1.ln_1.weight' (expected shape [8], f32)"),
        "{e}"
    );
}

#[test]
fn single_safetensors_files_check_dtype_truncation_and_corruption() {
    let d = tmp_dir("single");
    let sd = launch(&LaunchOptions::new(1), |pg: Group| {
        Ok(full_sd(&mut wrapped(pg, 1, 8)?))
    })
    .unwrap()
    .remove(0);
    let good = d.join("model.safetensors");
    save_state_dict_file(&good, &sd).unwrap();
    let back = load_state_dict_file(&good).unwrap();
    assert_eq!(back.len(), sd.len());
    // Wrong dtype: refused naming the parameter.
    let mut bf = sd.clone();
    let i = bf
        .tensors
        .iter()
        .position(|(n, _)| n == "blocks.0.mlp.c_fc.weight")
        .unwrap();
    bf.tensors[i].1 = bf.tensors[i].1.to_dtype(DType::BF16).unwrap();
    let p = d.join("bf16.safetensors");
    save_state_dict_file(&p, &bf).unwrap();
    let loaded = load_state_dict_file(&p).unwrap();
    let e = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = wrapped(pg, 1, 8)?;
        Ok(m.load_state_dict(&StateDict::Full(loaded.clone()), true)
            .unwrap_err()
            .to_string())
    })
    .unwrap()
    .remove(0);
    assert!(
        e.contains("'blocks.0.mlp.c_fc.weight': expected dtype f32 or f64, got bf16"),
        "{e}"
    );
    // Truncated and corrupted single files.
    let bytes = std::fs::read(&good).unwrap();
    let t = d.join("truncated.safetensors");
    std::fs::write(&t, &bytes[..bytes.len() - 10]).unwrap();
    let e = load_state_dict_file(&t).unwrap_err().to_string();
    assert!(
        e.contains("truncated.safetensors") && e.contains("truncated"),
        "{e}"
    );
    let mut c = bytes.clone();
    let at = c.len() - 5;
    c[at] ^= 1;
    let cp = d.join("corrupted.safetensors");
    std::fs::write(&cp, &c).unwrap();
    let e = load_state_dict_file(&cp).unwrap_err().to_string();
    assert!(
        e.contains("corrupted.safetensors") && e.contains("checksum mismatch"),
        "{e}"
    );
    let _ = Tensor::zeros(&[1], DType::F32);
}

/// Child-process entry: saves generation 2 into the directory `FSDP_TEST_CRASH_DIR` while
/// the `FSDP_CKPT_STALL` hook stalls it; the parent kills this process. A no-op in a normal
/// test run.
#[test]
fn crash_child_entry() {
    let Ok(dir) = std::env::var("FSDP_TEST_CRASH_DIR") else {
        return;
    };
    launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = wrapped(pg, 2, 8)?;
        let zeros = FullStateDict {
            tensors: zeros_like(&mut m),
        };
        m.load_state_dict(&StateDict::Full(zeros), true)?;
        let opt = AdamW::new(AdamConfig::adamw());
        save_checkpoint(
            Path::new(&dir),
            &mut m,
            Some(&opt as &dyn Optimizer),
            StateDictType::Sharded,
            serde_json::json!({"step": 2}),
        )
    })
    .unwrap();
}

fn zeros_like(m: &mut FullyShardedDataParallel) -> Vec<(String, Tensor)> {
    full_sd(m)
        .tensors
        .into_iter()
        .map(|(n, t)| (n, Tensor::zeros(t.shape(), DType::F32)))
        .collect()
}

#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the FSDP_CKPT_STALL hook: cargo test --features test-hooks"
)]
fn a_save_killed_midway_in_place_leaves_the_previous_checkpoint_loadable() {
    let d = tmp_dir("crash-in-place");
    save_small(&d, StateDictType::Sharded, 2, 8);
    let before = read_index(&d).unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        &common::test_name(module_path!(), "crash_child_entry"),
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("FSDP_TEST_CRASH_DIR", &d)
    .env("FSDP_CKPT_STALL", "-g2.safetensors");
    let line = kill_mid_save(cmd);
    assert!(line.contains("-g2.safetensors"), "{line}");
    // The index still names generation 1, whose files are intact: it loads, and the
    // killed save's zeros are nowhere.
    let after = read_index(&d).unwrap();
    assert_eq!((after.generation, &after.files), (1, &before.files));
    let tmp_left = std::fs::read_dir(&d).unwrap().any(|e| {
        e.unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".fsdp-tmp")
    });
    assert!(tmp_left, "the kill did not happen mid-write");
    let sds = launch(&LaunchOptions::new(3), |pg: Group| {
        let mut m = wrapped(pg, 2, 8)?;
        let mut opt = AdamW::new(AdamConfig::adamw());
        load_checkpoint(&d, &mut m, Some(&mut opt as &mut dyn Optimizer))?;
        Ok(full_sd(&mut m))
    })
    .unwrap();
    let want = launch(&LaunchOptions::new(1), |pg: Group| {
        Ok(full_sd(&mut wrapped(pg, 2, 8)?))
    })
    .unwrap()
    .remove(0);
    assert!(same(&sds[0], &want));
    // The next save cleans up and succeeds.
    save_small(&d, StateDictType::Sharded, 2, 8);
    assert_eq!(read_index(&d).unwrap().generation, 2);
}

fn optim_full(m: &mut FullyShardedDataParallel, opt: &AdamW) -> Vec<(String, Vec<u32>)> {
    let o = m
        .optim_state_dict(opt, StateDictConfig::Full(FullStateDictConfig::default()))
        .unwrap();
    let mut out: Vec<(String, Vec<u32>)> = o
        .steps
        .iter()
        .map(|(n, s)| (format!("step/{n}"), vec![*s as u32]))
        .collect();
    for (b, sd) in &o.buffers {
        let StateDict::Full(f) = sd else {
            unreachable!()
        };
        for (n, t) in &f.tensors {
            let bits = t
                .to_vec_f32()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            out.push((format!("{b}/{n}"), bits));
        }
    }
    out.sort();
    out
}

#[test]
fn checkpoint_files_from_world_size_4_load_at_1_2_3_4_bitwise_with_adam_moments() {
    use fsdp::nn::{loss, Context, Module};
    for (strategy, ty) in [
        (ShardingStrategy::HybridShard, StateDictType::Sharded),
        (ShardingStrategy::NoShard, StateDictType::Sharded),
        (ShardingStrategy::FullShard, StateDictType::Full),
    ] {
        let dir = tmp_dir(&format!("files-{strategy:?}-{ty:?}"));
        let saved = launch(&LaunchOptions::new(4), |pg: Group| {
            let cfg = FsdpConfig {
                sharding_strategy: strategy,
                ranks_per_node: strategy.is_hybrid().then_some(2),
                auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
                ..Default::default()
            };
            let mut m = FullyShardedDataParallel::new(small_gpt(2, 8), pg.clone(), cfg)?;
            let mut opt = AdamW::new(AdamConfig::adamw());
            for step in 0..2 {
                let ids: Vec<i32> = (0..12)
                    .map(|i| ((i * 7 + step * 3 + pg.rank()) % 29) as i32)
                    .collect();
                let logits = m.forward(&Tensor::from_vec(ids, &[2, 6])?, &Context::train())?;
                let (_, g) = loss::sum_loss(&logits)?;
                m.backward(&g, &Context::train())?;
                opt.step(&m.optimizer_params())?;
                m.zero_grad();
            }
            save_checkpoint(
                &dir,
                &mut m,
                Some(&opt as &dyn Optimizer),
                ty,
                serde_json::json!({}),
            )?;
            Ok((full_sd(&mut m), optim_full(&mut m, &opt)))
        })
        .unwrap()
        .remove(0);
        for w in 1..=4 {
            let got = launch(&LaunchOptions::new(w), |pg: Group| {
                let mut m = wrapped(pg, 2, 8)?;
                let mut opt = AdamW::new(AdamConfig::adamw());
                load_checkpoint(&dir, &mut m, Some(&mut opt as &mut dyn Optimizer))?;
                Ok((full_sd(&mut m), optim_full(&mut m, &opt)))
            })
            .unwrap_or_else(|e| panic!("{strategy:?} {ty:?} at {w}: {e}"));
            for (model, optim) in got {
                assert!(same(&model, &saved.0), "{strategy:?} {ty:?} at {w}: model");
                assert!(
                    optim == saved.1,
                    "{strategy:?} {ty:?} at {w}: optimizer state"
                );
                assert!(optim.iter().any(|(k, _)| k.starts_with("exp_avg_sq/")));
            }
        }
    }
}
