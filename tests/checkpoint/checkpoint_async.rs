//! Asynchronous checkpoints (`AsyncCheckpointer`, `fsdp train --async-save`; PyTorch's
//! `torch.distributed.checkpoint.async_save`): a background save holds the values of the
//! moment it was called even while training changes the model, writes the same files as
//! the synchronous save, resumes bitwise like it, and a failed background write is
//! reported at the next commit naming the file while the previous checkpoint still loads.
//! A process killed during a background write: crates/fsdp-cli/tests/cli/checkpoint.rs.

use crate::common;

use common::{corpus_file, small_job};
use fsdp::checkpoint::{
    load_checkpoint, read_index, read_tensors, save_checkpoint, AsyncCheckpointer,
};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullStateDictConfig, FullyShardedDataParallel,
    StateDict, StateDictConfig, StateDictType,
};
use fsdp::nn::{InitKey, Linear};
use fsdp::optim::{no_decay_groups, AdamConfig, AdamW, Optimizer, SgdConfig, SGD};
use fsdp::train::{train, Silent, TrainConfig};
use std::path::{Path, PathBuf};

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-async-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn linear(pg: Group, seed: u64) -> fsdp::Result<FullyShardedDataParallel> {
    let model = Linear::new(6, 5, true, &InitKey::new(seed))?;
    FullyShardedDataParallel::new(Box::new(model), pg, FsdpConfig::default())
}

/// The model's full state dict as `(name, f32 bits)`.
fn bits(m: &mut FullyShardedDataParallel) -> fsdp::Result<Vec<(String, Vec<u32>)>> {
    let sd = m.state_dict(StateDictConfig::Full(FullStateDictConfig::default()))?;
    let StateDict::Full(f) = sd else {
        return Err(fsdp::Error::Fsdp("not a full state dict".into()));
    };
    Ok(f.tensors
        .iter()
        .map(|(n, t)| (n.clone(), common::f32_bits(t)))
        .collect())
}

/// Every tensor of every data file of the checkpoint in `dir`, as `(file, key, bits)`
/// sorted.
fn file_tensors(dir: &Path) -> Vec<(String, String, Vec<u32>)> {
    let index = read_index(dir).unwrap();
    let mut out = Vec::new();
    for f in &index.files {
        let t = read_tensors(&dir.join(&f.name)).unwrap();
        for (k, v) in t.tensors {
            out.push((f.name.clone(), k, common::f32_bits(&v)));
        }
    }
    out.sort();
    out
}

/// The background save holds the values of the call even though the model changes
/// before the files are written; the directory's index moves only at the commit. Two saves
/// into one directory back to back (the first one's index written in the background while
/// the second is staged) take consecutive generations; a write that fails (rank 1's file
/// cannot be renamed into place) is reported at the commit on every rank naming the file,
/// and the previous checkpoint loads.
#[test]
fn a_background_save_keeps_the_values_of_the_call_and_a_failed_write_names_the_file() {
    let dir = tmp_dir("values");
    let dir2 = dir.clone();
    let save = |ckpt: &mut AsyncCheckpointer, m: &mut FullyShardedDataParallel, step: u64| {
        ckpt.save_checkpoint_async(
            &dir2,
            m,
            None,
            StateDictType::Sharded,
            serde_json::json!({ "step": step }),
        )
    };
    let results = launch(&LaunchOptions::new(2), |pg: Group| {
        let dir = dir2.clone();
        let mut m = linear(pg.clone(), 1)?;
        let first = bits(&mut m)?;
        let mut ckpt = AsyncCheckpointer::new();
        assert!(save(&mut ckpt, &mut m, 1)?.is_empty());
        assert_eq!(ckpt.in_flight(), Some(dir.as_path()));
        // Training changes the model while the files are written.
        let other = linear(pg.clone(), 2)?.state_dict(StateDictConfig::Sharded)?;
        m.load_state_dict(&other, true)?;
        let second = bits(&mut m)?;
        assert_ne!(second, first);
        assert_eq!(ckpt.wait()?, vec![dir.clone()]);
        assert!(ckpt.wait()?.is_empty());
        let mut fresh = linear(pg.clone(), 3)?;
        load_checkpoint(&dir, &mut fresh, None)?;
        assert_eq!(bits(&mut fresh)?, first);
        // Generation 2 holds `second`; generation 3 fails: rank 1's file name is taken by
        // a non-empty directory.
        save(&mut ckpt, &mut m, 2)?;
        let blocker = dir.join("rank-00001-g3.safetensors");
        if pg.rank() == 1 {
            std::fs::create_dir_all(blocker.join("x")).unwrap();
        }
        save(&mut ckpt, &mut m, 3)?;
        let err = ckpt.wait().unwrap_err().to_string();
        if pg.rank() == 1 {
            std::fs::remove_dir_all(&blocker).unwrap();
        }
        // The index names generation 2, which loads the values of its call.
        let info = load_checkpoint(&dir, &mut fresh, None)?;
        Ok((second, bits(&mut fresh)?, info.extra, err))
    })
    .unwrap();
    for (rank, (saved, loaded, extra, err)) in results.into_iter().enumerate() {
        assert_eq!(loaded, saved, "rank {rank}");
        assert_eq!(extra, serde_json::json!({"step": 2}));
        assert!(
            err.contains("rank-00001-g3.safetensors")
                && (err.contains("previous checkpoint is untouched")
                    || err.contains("the index was not replaced")),
            "rank {rank}: {err}"
        );
    }
    let index = read_index(&dir).unwrap();
    assert_eq!(index.generation, 2);
    // Generation 1's files went when generation 2's index was written.
    assert!(!dir.join("rank-00000-g1.safetensors").exists());
}

/// `fsdp train --async-save` writes the same checkpoint files as the synchronous save,
/// bit for bit (the step-4 checkpoint while steps 5.. train), and a resume from either
/// continues with bitwise equal losses and final checkpoint.
#[test]
fn async_saved_checkpoints_equal_sync_ones_and_resume_bitwise() {
    let data = corpus_file("async-resume");
    let run = |name: &str, async_save: bool, resume: Option<PathBuf>, steps: usize| {
        let save = tmp_dir(name);
        let cfg = TrainConfig {
            steps,
            save_every: 4,
            save_dir: Some(save.clone()),
            async_save,
            resume,
            ..small_job(data.clone(), 2)
        };
        (train(&cfg, &Silent).unwrap(), save)
    };
    let (sync, sync_dir) = run("sync", false, None, 8);
    let (bg, bg_dir) = run("async", true, None, 8);
    assert_eq!(
        bg.losses().iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        sync.losses()
            .iter()
            .map(|l| l.to_bits())
            .collect::<Vec<_>>()
    );
    assert_eq!(
        std::fs::read_to_string(bg_dir.join("latest"))
            .unwrap()
            .trim(),
        "step-00000008"
    );
    for step in ["step-00000004", "step-00000008"] {
        let (a, b) = (
            file_tensors(&sync_dir.join(step)),
            file_tensors(&bg_dir.join(step)),
        );
        assert!(!a.is_empty());
        assert_eq!(a, b, "{step}");
    }
    let from_sync = run("from-sync", false, Some(sync_dir.join("step-00000004")), 8);
    let from_async = run("from-async", true, Some(bg_dir.join("step-00000004")), 8);
    let want: Vec<u32> = sync.losses()[4..].iter().map(|l| l.to_bits()).collect();
    for (what, (report, dir)) in [("sync", &from_sync), ("async", &from_async)] {
        let got: Vec<u32> = report.losses().iter().map(|l| l.to_bits()).collect();
        assert_eq!(got, want, "resumed from the {what} checkpoint");
        assert_eq!(
            file_tensors(&dir.join("step-00000008")),
            file_tensors(&sync_dir.join("step-00000008")),
            "parameters and optimizer state after resuming from the {what} checkpoint"
        );
    }
}

/// Rank 0's background index thread fails (here its `on_commit` hook): the next commit
/// reports it on every rank with rank 0's message, and the index that was written before
/// the hook ran still loads.
#[test]
fn a_failed_index_thread_is_reported_on_every_rank_at_the_next_commit() {
    let dir = tmp_dir("hook");
    let results = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = linear(pg.clone(), 1)?;
        let want = bits(&mut m)?;
        let mut ckpt = AsyncCheckpointer::new().on_commit(|d: &Path| {
            Err(fsdp::Error::Checkpoint {
                path: d.join("latest-of-the-test").display().to_string(),
                detail: "the hook refused".into(),
            })
        });
        let mut save = |m: &mut FullyShardedDataParallel, sub: &str| {
            ckpt.save_checkpoint_async(
                &dir.join(sub),
                m,
                None,
                StateDictType::Sharded,
                serde_json::json!({}),
            )
        };
        save(&mut m, "a")?;
        // Commits "a"; rank 0 writes its index, then the hook fails in the background.
        save(&mut m, "b")?;
        let err = ckpt.wait().unwrap_err().to_string();
        let mut fresh = linear(pg.clone(), 2)?;
        load_checkpoint(&dir.join("a"), &mut fresh, None)?;
        Ok((want, bits(&mut fresh)?, err))
    })
    .unwrap();
    for (rank, (want, loaded, err)) in results.into_iter().enumerate() {
        assert_eq!(loaded, want, "rank {rank}");
        assert!(
            err.contains("latest-of-the-test") && err.contains("the hook refused"),
            "rank {rank}: {err}"
        );
    }
    // "b" was not committed: its files are there, its index is not.
    assert!(read_index(&dir.join("b")).is_err());
}

/// Every file of checkpoint directory `dir`: `(name, bytes)`, sorted by name.
fn dir_bytes(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// A background save writes the same bytes as the synchronous save of the same moment:
/// every data file and the index, byte for byte, sharded and full, AdamW with parameter
/// groups (their names are all-reduced on the training thread) and SGD with momentum, at 3
/// ranks (no unit's elements split evenly), although training changes the model and the
/// optimizer's state before the files are written. The second save of each run reuses the
/// host buffers of the first.
#[test]
fn async_files_and_index_equal_the_sync_ones_byte_for_byte() {
    for ty in [StateDictType::Sharded, StateDictType::Full] {
        for sgd in [false, true] {
            let root = tmp_dir(&format!("bytes-{ty:?}-{sgd}"));
            let dirs: Vec<(PathBuf, PathBuf)> = (1..=2)
                .map(|i| {
                    (
                        root.join(format!("sync-{i}")),
                        root.join(format!("async-{i}")),
                    )
                })
                .collect();
            launch(&LaunchOptions::new(3), |pg: Group| {
                let cfg = FsdpConfig {
                    auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
                    ..Default::default()
                };
                let mut m = FullyShardedDataParallel::new(common::small_gpt(2), pg.clone(), cfg)?;
                let mut opt: Box<dyn Optimizer> = if sgd {
                    Box::new(SGD::new(SgdConfig {
                        lr: 1e-2,
                        momentum: 0.9,
                        ..Default::default()
                    }))
                } else {
                    let shapes: Vec<Vec<usize>> = m
                        .optimizer_param_names()
                        .into_iter()
                        .map(|(_, s)| s)
                        .collect();
                    let mut a = AdamW::new(AdamConfig::adamw());
                    a.set_param_groups(no_decay_groups(&shapes, 1e-2, 0.1))?;
                    Box::new(a)
                };
                let lo = 4 * pg.rank();
                let step = |m: &mut FullyShardedDataParallel,
                            opt: &mut Box<dyn Optimizer>,
                            s: usize|
                 -> fsdp::Result<()> {
                    common::gpt_step(m, s, lo, lo + 4)?;
                    opt.step(&m.optimizer_params())?;
                    m.zero_grad();
                    Ok(())
                };
                step(&mut m, &mut opt, 0)?;
                step(&mut m, &mut opt, 1)?;
                let mut ckpt = AsyncCheckpointer::new();
                for (i, (sync_dir, async_dir)) in dirs.iter().enumerate() {
                    let extra = serde_json::json!({ "save": i });
                    save_checkpoint(sync_dir, &mut m, Some(opt.as_ref()), ty, extra.clone())?;
                    ckpt.save_checkpoint_async(async_dir, &mut m, Some(opt.as_ref()), ty, extra)?;
                    // Training changes the parameters and moments while the files are written.
                    step(&mut m, &mut opt, 2 + i)?;
                }
                ckpt.wait()?;
                Ok(())
            })
            .unwrap();
            for (sync_dir, async_dir) in &dirs {
                let (a, b) = (dir_bytes(sync_dir), dir_bytes(async_dir));
                let names =
                    |v: &[(String, Vec<u8>)]| v.iter().map(|f| f.0.clone()).collect::<Vec<_>>();
                assert_eq!(names(&a), names(&b), "{ty:?} sgd={sgd}");
                assert!(a.iter().any(|f| f.0 == "index.json") && a.len() > 1);
                for (fa, fb) in a.iter().zip(&b) {
                    assert!(fa.1 == fb.1, "{ty:?} sgd={sgd}: {} differs", fa.0);
                }
            }
        }
    }
}
