//! Checkpoint files: resume at another world size and strategy continues the loss curve;
//! a process killed in the middle of a save leaves the previous checkpoint loadable;
//! truncated, corrupted and mismatched checkpoints are refused naming the file or the
//! parameter, before anything is modified.

mod common;

use common::{corpus_file, small_job};
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
use fsdp::train::{train, CheckpointType, Silent, TrainConfig};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn resume_at_world_size_2_with_another_strategy_continues_the_loss_curve() {
    let data = corpus_file("resume");
    let save = tmp_dir("resume");
    let full = TrainConfig {
        steps: 40,
        save_dir: Some(save.clone()),
        save_every: 20,
        ..small_job(data.clone(), 4)
    };
    let base = train(&full, &Silent).unwrap();
    assert_eq!(base.records.len(), 40);
    let latest = std::fs::read_to_string(save.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step-00000040");
    for (world, strategy, ty) in [
        (2, ShardingStrategy::ShardGradOp, CheckpointType::Sharded),
        (1, ShardingStrategy::NoShard, CheckpointType::Full),
    ] {
        // The full-layout case saves its own step-20 checkpoint first.
        let from = if ty == CheckpointType::Full {
            let dir = tmp_dir("resume-full");
            train(
                &TrainConfig {
                    steps: 20,
                    save_dir: Some(dir.clone()),
                    checkpoint_type: ty,
                    ..small_job(data.clone(), 4)
                },
                &Silent,
            )
            .unwrap();
            dir // its latest is step 20
        } else {
            save.join("step-00000020")
        };
        let resumed = train(
            &TrainConfig {
                steps: 40,
                strategy,
                resume: Some(from),
                ..small_job(data.clone(), world)
            },
            &Silent,
        )
        .unwrap_or_else(|e| panic!("resume at {world} {strategy:?}: {e}"));
        assert_eq!(resumed.records.first().map(|r| r.step), Some(21));
        assert_eq!(resumed.records.len(), 20);
        for (r, b) in resumed.records.iter().zip(&base.records[20..]) {
            assert_eq!(r.step, b.step);
            assert!(
                (r.loss - b.loss).abs() <= 1e-4 * b.loss.abs(),
                "world size {world} {strategy:?} {ty:?}: step {} loss {} vs uninterrupted {}",
                r.step,
                r.loss,
                b.loss
            );
        }
    }
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
    let text = std::fs::read_to_string(&idx).unwrap();
    let name = text
        .split('"')
        .find(|s| s.ends_with(".safetensors"))
        .unwrap()
        .to_string();
    std::fs::write(&idx, text.replace(&name, "../../../../etc/passwd")).unwrap();
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
        e.contains("'blocks.0.mlp.c_fc.weight': expected dtype f32, got bf16"),
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

/// Spawns `cmd`, waits until it prints the stall line on stderr, kills it.
fn kill_mid_save(mut cmd: Command) -> String {
    let mut child = cmd
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    let mut seen = String::new();
    loop {
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(l) if l.contains("FSDP_CKPT_STALL: stalled writing") => {
                child.kill().unwrap();
                child.wait().unwrap();
                return l;
            }
            Ok(l) => seen.push_str(&(l + "\n")),
            Err(_) => {}
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("child exited ({status}) before stalling: {seen}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "child never stalled: {seen}"
        );
    }
}

#[test]
fn a_save_killed_midway_in_place_leaves_the_previous_checkpoint_loadable() {
    let d = tmp_dir("crash-in-place");
    save_small(&d, StateDictType::Sharded, 2, 8);
    let before = read_index(&d).unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "crash_child_entry",
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

#[test]
fn fsdp_train_killed_during_a_save_resumes_from_the_previous_checkpoint() {
    let data = corpus_file("crash-cli");
    let save = tmp_dir("crash-cli");
    let args = |world: &str, extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fsdp"));
        cmd.arg("train").args([
            "--data",
            data.to_str().unwrap(),
            "--world-size",
            world,
            "--steps",
            "4",
            "--global-batch",
            "8",
            "--seq-len",
            "16",
            "--n-layer",
            "2",
            "--n-head",
            "4",
            "--n-embd",
            "32",
            "--warmup-steps",
            "0",
            "--eval-every",
            "0",
            "--sample-len",
            "0",
            "--save-dir",
            save.to_str().unwrap(),
            "--save-every",
            "2",
        ]);
        cmd.args(extra);
        cmd
    };
    let mut cmd = args("2", &[]);
    cmd.env("FSDP_CKPT_STALL", "step-00000004");
    kill_mid_save(cmd);
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "step-00000002"
    );
    // The interrupted save is not a checkpoint.
    let e = launch(&LaunchOptions::new(1), |pg: Group| {
        let mut m = wrapped(pg, 2, 8)?;
        Ok(load_checkpoint(&save.join("step-00000004"), &mut m, None)
            .unwrap_err()
            .to_string())
    })
    .unwrap()
    .remove(0);
    assert!(
        e.contains("step-00000004") && e.contains("neither index.json"),
        "{e}"
    );
    // Resuming from the save directory continues from step 2, at another world size.
    let out = args(
        "4",
        &["--resume", save.to_str().unwrap(), "--log-every", "1"],
    )
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("resumed from") && stdout.contains("after step 2"),
        "{stdout}"
    );
    assert!(
        stdout.contains("step     3 |") && !stdout.contains("step     1 |"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "step-00000004"
    );
}

#[test]
fn bad_checkpoint_options_are_one_line_errors() {
    let data = corpus_file("ckpt-cli");
    let held = tmp_dir("ckpt-cli-held");
    std::fs::write(held.join("notes.txt"), "mine").unwrap();
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_fsdp"))
            .arg("train")
            .args(["--data", data.to_str().unwrap(), "--steps", "2"])
            .args(extra)
            .output()
            .unwrap()
    };
    for (args, want) in [
        (vec!["--save-every", "5"], "--save-every 5 needs --save-dir"),
        (
            vec!["--resume", "/nonexistent/ckpt"],
            "holds neither index.json",
        ),
        (
            vec!["--keep-last", "0", "--save-dir", "/tmp/x"],
            "--keep-last must be at least 1",
        ),
        // Refused before training, not at the first save.
        (
            vec!["--save-dir", "/proc/no-such-dir/ck"],
            "cannot create or write checkpoints there",
        ),
        (vec!["--overwrite"], "--overwrite needs --save-dir"),
        (
            vec!["--save-dir", held.to_str().unwrap()],
            "is not empty (it holds notes.txt)",
        ),
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
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

#[test]
fn resuming_with_options_that_change_the_trajectory_is_refused_naming_them() {
    let data = corpus_file("ckpt-diff");
    let save = tmp_dir("ckpt-diff");
    let base = TrainConfig {
        steps: 4,
        save_dir: Some(save.clone()),
        ..small_job(data.clone(), 2)
    };
    train(&base, &Silent).unwrap();
    let resume = |cfg: TrainConfig| {
        TrainConfig {
            steps: 8,
            save_dir: None,
            resume: Some(save.clone()),
            ..cfg
        }
        .validate()
    };
    // World size, strategy and a longer run are fine (constant lr, no warm-up here).
    resume(TrainConfig {
        world_size: 4,
        strategy: ShardingStrategy::ShardGradOp,
        ..base.clone()
    })
    .unwrap();
    let err = resume(TrainConfig {
        lr: base.lr * 2.0,
        n_head: 2,
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--lr") && err.contains("--n-head 2 (checkpoint: 4)"),
        "{err}"
    );
    let err = resume(TrainConfig {
        warmup_steps: 3,
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("warm-up (3 steps; checkpoint: 0"), "{err}");
    // Every differing option is named, with values as a user writes them.
    let err = resume(TrainConfig {
        lr: base.lr * 2.0,
        seed: base.seed + 1,
        optimizer: fsdp::optim::OptimizerKind::Sgd,
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    for want in [
        format!("--lr {} (checkpoint: {})", base.lr * 2.0, base.lr),
        format!("--seed {} (checkpoint: {}", base.seed + 1, base.seed),
        "--optimizer sgd (checkpoint: ".to_string(),
    ] {
        assert!(err.contains(&want), "{want} in: {err}");
    }
}

/// A fresh run refuses a save directory holding another run's checkpoints (they would
/// mix, `latest` would jump between runs and rotation would delete the wrong ones),
/// naming the way out; `--overwrite` deletes only the checkpoints `fsdp` wrote there.
#[test]
fn a_save_dir_of_another_run_is_refused_and_overwrite_keeps_other_files() {
    let data = corpus_file("save-dir-reuse");
    let save = tmp_dir("save-dir-reuse");
    let first = TrainConfig {
        steps: 4,
        save_every: 2,
        save_dir: Some(save.clone()),
        ..small_job(data.clone(), 2)
    };
    train(&first, &Silent).unwrap();
    std::fs::write(save.join("notes.txt"), "keep me").unwrap();
    std::fs::write(save.join("step-00000004").join("README"), "mine too").unwrap();
    let second = TrainConfig {
        steps: 3,
        save_every: 3,
        seed: 7,
        save_dir: Some(save.clone()),
        ..small_job(data.clone(), 2)
    };
    let err = train(&second, &Silent).unwrap_err().to_string();
    for want in [
        format!("--save-dir {} is not empty", save.display()),
        format!("--resume {}", save.display()),
        "--overwrite".to_string(),
    ] {
        assert!(err.contains(&want), "'{want}' in: {err}");
    }
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "step-00000004"
    );
    // Resuming the run saved there is what the directory is for.
    TrainConfig {
        steps: 6,
        resume: Some(save.clone()),
        ..first.clone()
    }
    .validate()
    .unwrap();
    train(
        &TrainConfig {
            overwrite: true,
            ..second
        },
        &Silent,
    )
    .unwrap();
    let mut left: Vec<String> = std::fs::read_dir(&save)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    // step-00000004 keeps the user's file, and nothing of the old checkpoint.
    assert_eq!(
        left,
        ["latest", "notes.txt", "step-00000003", "step-00000004"],
        "{left:?}"
    );
    let old: Vec<_> = std::fs::read_dir(save.join("step-00000004"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(old, [std::ffi::OsString::from("README")]);
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "step-00000003"
    );
}

/// `--keep-last` deletes only this run's older checkpoints: a checkpoint of another run
/// in the same directory stays, however old.
#[test]
fn rotation_deletes_only_this_runs_checkpoints() {
    let data = corpus_file("rotation");
    let save = tmp_dir("rotation");
    let other = tmp_dir("rotation-other");
    train(
        &TrainConfig {
            steps: 1,
            save_dir: Some(other.clone()),
            ..small_job(data.clone(), 1)
        },
        &Silent,
    )
    .unwrap();
    let run = TrainConfig {
        steps: 4,
        save_every: 2,
        keep_last: 1,
        save_dir: Some(save.clone()),
        ..small_job(data.clone(), 1)
    };
    train(&run, &Silent).unwrap();
    // Another run's checkpoint lands in the directory (copied by hand).
    let foreign = save.join("step-00000001");
    std::fs::create_dir(&foreign).unwrap();
    for e in std::fs::read_dir(other.join("step-00000001")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), foreign.join(e.file_name())).unwrap();
    }
    train(
        &TrainConfig {
            steps: 8,
            resume: Some(save.clone()),
            ..run
        },
        &Silent,
    )
    .unwrap();
    let mut left: Vec<String> = std::fs::read_dir(&save)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["latest", "step-00000001", "step-00000008"],
        "{left:?}"
    );
}

/// Steps of a metrics file: the `step` of every line.
fn metric_steps(path: &Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), l.to_string())
        })
        .collect()
}

/// `--resume --metrics FILE` keeps the records of the steps before the resumed one, drops
/// the later ones (trained again) and appends.
#[test]
fn resuming_keeps_the_metrics_of_the_steps_before_the_resumed_one() {
    let data = corpus_file("metrics-resume");
    let save = tmp_dir("metrics-resume");
    let metrics = save.with_file_name(format!(
        "fsdp-ckpt-{}-metrics-resume.jsonl",
        std::process::id()
    ));
    let run = TrainConfig {
        steps: 4,
        save_every: 2,
        save_dir: Some(save.clone()),
        metrics: Some(metrics.clone()),
        ..small_job(data.clone(), 2)
    };
    train(&run, &Silent).unwrap();
    let before = metric_steps(&metrics);
    assert_eq!(before.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
    train(
        &TrainConfig {
            steps: 5,
            save_dir: None,
            save_every: 0,
            resume: Some(save.join("step-00000002")),
            ..run
        },
        &Silent,
    )
    .unwrap();
    let after = metric_steps(&metrics);
    assert_eq!(
        after.iter().map(|s| s.0).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5]
    );
    assert_eq!(after[..2], before[..2]);
    let _ = std::fs::remove_file(&metrics);
}

/// `--resume` with another `--data` file is refused naming both files; a copy of the
/// same data elsewhere is recognized by its checksum.
#[test]
fn resuming_with_another_data_file_is_refused_and_a_copy_is_accepted() {
    let data = corpus_file("data-resume");
    let save = tmp_dir("data-resume");
    let base = TrainConfig {
        steps: 2,
        save_dir: Some(save.clone()),
        ..small_job(data.clone(), 1)
    };
    train(&base, &Silent).unwrap();
    let resume = |d: &Path| {
        TrainConfig {
            steps: 4,
            save_dir: None,
            resume: Some(save.clone()),
            data: d.to_path_buf(),
            ..base.clone()
        }
        .validate()
    };
    let other = save.join("other.txt");
    let mut text = std::fs::read_to_string(&data).unwrap();
    text.replace_range(..3, "THE");
    std::fs::write(&other, &text).unwrap();
    let err = resume(&other).unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "--data {} (checkpoint: {}; the contents differ",
            other.display(),
            data.display()
        )),
        "{err}"
    );
    let copy = save.join("copy.txt");
    std::fs::copy(&data, &copy).unwrap();
    resume(&copy).unwrap();
    resume(&data).unwrap();
}

/// An edited `index.json` (`world_size`, `step`) is refused naming the field, both values
/// and the index, instead of being trusted.
#[test]
fn an_edited_index_is_refused_naming_the_field_and_both_values() {
    let data = corpus_file("edited-index");
    let save = tmp_dir("edited-index");
    let base = TrainConfig {
        steps: 4,
        save_dir: Some(save.clone()),
        ..small_job(data.clone(), 2)
    };
    train(&base, &Silent).unwrap();
    let saved = save.join("step-00000004");
    // A copy of the checkpoint under `name` with its index edited by `edit`.
    let edited = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let dir = save.join("copies").join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for e in std::fs::read_dir(&saved).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
        let p = dir.join("index.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
        let err = TrainConfig {
            steps: 8,
            save_dir: None,
            resume: Some(dir.clone()),
            ..base.clone()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(err.contains(&p.display().to_string()), "{err}");
        err
    };
    let err = edited("ws1", &|v| v["world_size"] = 1.into());
    assert!(
        err.contains(
            "world_size 1 disagrees with file 'rank-00001-g1.safetensors', written by rank 1"
        ),
        "{err}"
    );
    let err = edited("ws4", &|v| v["world_size"] = 4.into());
    assert!(
        err.contains("world_size 4 disagrees with extra.world_size 2"),
        "{err}"
    );
    let err = edited("step-00000004", &|v| v["extra"]["step"] = 2.into());
    assert!(
        err.contains("step 2 disagrees with the directory name step-00000004 (step 4)"),
        "{err}"
    );
    let err = edited("renamed", &|v| v["extra"]["step"] = 2.into());
    assert!(
        err.contains("step 2 disagrees with rng.next_step 5"),
        "{err}"
    );
    let err = edited("renamed", &|v| {
        v["extra"]["step"] = 2.into();
        v["extra"]["rng"]["next_step"] = 3.into();
    });
    assert!(
        err.contains("step 2 disagrees with the optimizer's step count 4"),
        "{err}"
    );
}
