//! `fsdp train --save-dir / --resume`: a resume at another world size and strategy continues
//! the loss curve; options that would change the trajectory, another data file, an edited
//! index or another run's save directory are refused naming what differs; rotation and
//! the metrics file keep what belongs to the run; a ZeRO-1 run saved at world size 4 (a
//! file per rank) resumes at 2.

use crate::common;

use common::{assert_close, corpus_file, no_shard_job, small_job};
use fsdp::fsdp::ShardingStrategy;
use fsdp::train::{train, CheckpointType, Silent, TrainConfig};
use std::path::{Path, PathBuf};

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-resume-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The sorted names of the entries of `dir`.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
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
        err.contains("pass the checkpoint's values: ")
            && err.contains("--lr")
            && err.contains("--n-head 4 (this run: 2)"),
        "{err}"
    );
    let err = resume(TrainConfig {
        warmup_steps: 3,
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("an lr warm-up of 0 steps (this run: 3; from --warmup-steps and --steps)"),
        "{err}"
    );
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
        format!("--lr {} (this run: {})", base.lr, base.lr * 2.0),
        format!(
            "--seed {} (this run: {}; it fixes the data order)",
            base.seed,
            base.seed + 1
        ),
        format!("--optimizer {} (this run: sgd)", base.optimizer),
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
    let left = entries(&save);
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
    let left = entries(&save);
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
/// the later ones (trained again) and lines that are no records, and appends.
#[test]
fn resuming_keeps_the_metrics_of_the_steps_before_the_resumed_one() {
    let data = corpus_file("metrics-resume");
    let save = tmp_dir("metrics-resume");
    let metrics = save.with_file_name(format!(
        "fsdp-resume-{}-metrics-resume.jsonl",
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
    // Lines that are not step records (garbage, a blank line, JSON without a step) are
    // dropped, wherever they are: the file stays one record per line.
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.insert_str(before[0].1.len() + 1, "garbage line\n\n");
    text.push_str("{\"note\": \"not a record\"}\nmore garbage\n");
    std::fs::write(&metrics, text).unwrap();
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
            "--data {} (this run: {}; the contents differ",
            data.display(),
            other.display()
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
        // The index's own checksums recomputed, as a careful editor would: what is left
        // to find the edit are the cross-checks.
        let index: fsdp::checkpoint::Index = serde_json::from_value(v).unwrap();
        std::fs::write(&p, fsdp::checkpoint::index_text(&index).unwrap()).unwrap();
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

/// `--resume` of a path that does not exist says so, before any other check (a save
/// directory that holds files is not the problem then): a checkpoint rotated away by
/// `--keep-last` names what its save directory holds and what `latest` names.
#[test]
fn a_missing_resume_path_is_named_before_the_save_dir_check() {
    let data = corpus_file("missing-ckpt");
    let save = tmp_dir("missing-ckpt");
    let run = TrainConfig {
        steps: 8,
        save_every: 2,
        keep_last: 2,
        save_dir: Some(save.clone()),
        ..small_job(data.clone(), 2)
    };
    train(&run, &Silent).unwrap();
    assert_eq!(entries(&save), ["latest", "step-00000006", "step-00000008"]);
    let resume = |from: &Path, save_dir: Option<PathBuf>| {
        TrainConfig {
            steps: 10,
            resume: Some(from.to_path_buf()),
            save_dir,
            ..run.clone()
        }
        .validate()
        .unwrap_err()
        .to_string()
    };
    let gone = save.join("step-00000004");
    let want = format!(
        "checkpoint '{}': does not exist; {} holds the checkpoints step-00000006, step-00000008 and its latest names step-00000008 (give {} to resume from it)",
        gone.display(),
        save.display(),
        save.display()
    );
    assert_eq!(resume(&gone, Some(save.clone())), want);
    assert_eq!(resume(&gone, None), want);
    // Nothing there at all: the path is named, with nothing else to add.
    let nowhere = tmp_dir("missing-ckpt-empty").join("nonexist-dir");
    assert_eq!(
        resume(&nowhere, Some(save.clone())),
        format!("checkpoint '{}': does not exist", nowhere.display())
    );
    // A save directory without `latest`: its checkpoints are named.
    std::fs::remove_file(save.join("latest")).unwrap();
    assert_eq!(
        resume(&save, Some(save.clone())),
        format!(
            "checkpoint '{}': holds neither index.json (a checkpoint) nor latest (a save directory); it holds the checkpoints step-00000006, step-00000008: give one of them",
            save.display()
        )
    );
}

#[test]
fn fsdp_train_saved_at_4_resumes_at_2_and_continues_the_uninterrupted_run() {
    let data = corpus_file("zero1-resume");
    let save = data.with_file_name("save");
    let _ = std::fs::remove_dir_all(&save);
    let base = train(
        &TrainConfig {
            steps: 10,
            save_dir: Some(save.clone()),
            save_every: 5,
            ..no_shard_job(&data, 4, true)
        },
        &Silent,
    )
    .unwrap();
    let step5 = save.join("step-00000005");
    let ranks = std::fs::read_dir(&step5)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("rank-")
        })
        .count();
    assert_eq!(
        ranks, 4,
        "every rank saves its chunk of the optimizer state"
    );
    let resumed = train(
        &TrainConfig {
            steps: 10,
            resume: Some(step5),
            ..no_shard_job(&data, 2, true)
        },
        &Silent,
    )
    .unwrap();
    assert_eq!(resumed.records.first().map(|r| r.step), Some(6));
    let want: Vec<f32> = base.losses()[5..].to_vec();
    assert_close("resumed at 2", &resumed.losses(), &want, 1e-5, 1e-5);
}
