//! Checkpoints through the `fsdp` binary: `fsdp train` killed during a save resumes from
//! the previous checkpoint, and bad checkpoint options are one-line errors. The library's
//! checkpoint files: tests/checkpoint/checkpoint.rs at the workspace root.

use crate::common;

use common::{corpus_file, kill_mid_save};
use fsdp::checkpoint::load_checkpoint;
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel};
use fsdp::nn::{InitKey, Linear};
use std::path::PathBuf;
use std::process::Command;

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the FSDP_CKPT_STALL hook: cargo test --features test-hooks"
)]
fn fsdp_train_killed_during_a_save_resumes_from_the_previous_checkpoint() {
    killed_during_a_save(&[], 4);
}

/// `--async-save`, 6 steps: the background writer of the last save (step 6) stalls; the
/// end of training waits for it and the process is killed there. Step 2's index was
/// written before step 6's save began, step 4's in the background while step 6's files
/// were written: `latest` names one of them, and it resumes.
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the FSDP_CKPT_STALL hook: cargo test --features test-hooks"
)]
fn fsdp_train_killed_during_a_background_save_resumes_from_the_previous_checkpoint() {
    killed_during_a_save(&["--async-save"], 6);
}

/// `fsdp train --steps <steps> --save-every 2` with `mode`'s options, killed while it
/// writes the last step's checkpoint, leaves an earlier one loadable as `latest` (step
/// `steps - 2`; with `--async-save` `steps - 4` or `steps - 2`), and a resume from the save
/// directory continues after it.
fn killed_during_a_save(mode: &[&str], steps: usize) {
    let steps_arg = steps.to_string();
    let tag = if mode.is_empty() { "sync" } else { "async" };
    let data = corpus_file(&format!("crash-cli-{tag}"));
    let save = tmp_dir(&format!("crash-cli-{tag}"));
    let args = |world: &str, extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fsdp"));
        cmd.arg("train").args([
            "--data",
            data.to_str().unwrap(),
            "--world-size",
            world,
            "--steps",
            &steps_arg,
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
        cmd.args(mode).args(extra);
        cmd
    };
    let last = format!("step-{steps:08}");
    let mut cmd = args("2", &[]);
    cmd.env("FSDP_CKPT_STALL", &last);
    kill_mid_save(cmd);
    let latest = std::fs::read_to_string(save.join("latest")).unwrap();
    let kept: usize = latest
        .trim()
        .strip_prefix("step-")
        .unwrap()
        .parse()
        .unwrap();
    let allowed = if mode.is_empty() {
        vec![steps - 2]
    } else {
        vec![steps - 4, steps - 2]
    };
    assert!(allowed.contains(&kept), "latest: {latest}");
    // The interrupted save is not a checkpoint.
    let e = launch(&LaunchOptions::new(1), |pg: Group| {
        let model = Linear::new(4, 3, true, &InitKey::new(0))?;
        let mut m = FullyShardedDataParallel::new(Box::new(model), pg, FsdpConfig::default())?;
        Ok(load_checkpoint(&save.join(&last), &mut m, None)
            .unwrap_err()
            .to_string())
    })
    .unwrap()
    .remove(0);
    assert!(e.contains(&last) && e.contains("neither index.json"), "{e}");
    // Resuming from the save directory continues after `latest`, at another world size.
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
        stdout.contains("resumed from") && stdout.contains(&format!("after step {kept}")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("step {:>5} |", kept + 1))
            && !stdout.contains(&format!("step {kept:>5} | loss")),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        last
    );
}

/// `fsdp train --data DATA --steps 2 EXTRA`.
fn train_2_steps(data: &std::path::Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .arg("train")
        .args(["--data", data.to_str().unwrap(), "--steps", "2"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn bad_checkpoint_options_are_one_line_errors() {
    let data = corpus_file("ckpt-cli");
    let held = tmp_dir("ckpt-cli-held");
    std::fs::write(held.join("notes.txt"), "mine").unwrap();
    let run = |extra: &[&str]| train_2_steps(&data, extra);
    for (args, want) in [
        (vec!["--save-every", "5"], "--save-every 5 needs --save-dir"),
        (
            vec!["--resume", "/nonexistent/ckpt"],
            "error: checkpoint '/nonexistent/ckpt': does not exist",
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
        (vec!["--async-save"], "--async-save needs --save-dir"),
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

/// A resume with another model shape names the value the checkpoint needs, then this run's.
#[test]
fn a_resume_with_another_shape_names_the_checkpoints_value_to_pass() {
    let data = corpus_file("ckpt-cli-shape");
    let save = tmp_dir("ckpt-cli-shape");
    let train = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_fsdp"))
            .arg("train")
            .args(["--data", data.to_str().unwrap(), "--world-size", "1"])
            .args(["--n-layer", "1", "--n-head", "2", "--global-batch", "4"])
            .args(["--seq-len", "16", "--sample-len", "0", "--eval-every", "0"])
            .args(["--warmup-steps", "0"])
            .args(extra)
            .output()
            .unwrap()
    };
    let s = save.to_str().unwrap();
    let out = train(&["--n-embd", "32", "--steps", "2", "--save-dir", s]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for flag in ["--resume", "--resume-if-present"] {
        let mut args = vec!["--n-embd", "64", "--steps", "4", "--save-dir", s, flag];
        if flag == "--resume" {
            args.push(s);
        }
        let out = train(&args);
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!("error: invalid argument: --resume {s}: options differ from the checkpoint's run, so training would not continue it; pass the checkpoint's values: --n-embd 32 (this run: 64)\n"),
            "{flag}"
        );
    }
    let _ = std::fs::remove_dir_all(&save);
}

#[test]
fn resume_if_present_needs_a_save_dir_and_excludes_resume() {
    let data = corpus_file("ckpt-cli-rip");
    let run = |extra: &[&str]| train_2_steps(&data, extra);
    let out = run(&["--resume-if-present"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: invalid argument: --resume-if-present needs --save-dir (where to look for the checkpoint to resume)\n"
    );
    assert_eq!(out.status.code(), Some(1));
    let out = run(&[
        "--resume-if-present",
        "--resume",
        "/tmp/x",
        "--save-dir",
        "/tmp/x",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with(
            "error: the argument '--resume-if-present' cannot be used with '--resume <RESUME>'"
        ),
        "{err}"
    );
}
