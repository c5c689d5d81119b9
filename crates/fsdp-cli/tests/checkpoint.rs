//! Checkpoints through the `fsdp` binary: `fsdp train` killed during a save resumes from
//! the previous checkpoint, and bad checkpoint options are one-line errors. The library's
//! checkpoint files: tests/checkpoint.rs at the workspace root.

#[path = "../../../tests/common/mod.rs"]
mod common;

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
    killed_during_a_save(&[]);
}

/// `--async-save`: the background writer of the last save (step 4) stalls; the end of
/// training waits for it and the process is killed there. Step 2, committed when step 4's
/// save started, stays `latest` and resumes.
#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the FSDP_CKPT_STALL hook: cargo test --features test-hooks"
)]
fn fsdp_train_killed_during_a_background_save_resumes_from_the_previous_checkpoint() {
    killed_during_a_save(&["--async-save"]);
}

/// `fsdp train` with `mode`'s options, killed while it writes step 4's checkpoint, leaves
/// step 2 loadable, and a resume from the save directory continues after step 2.
fn killed_during_a_save(mode: &[&str]) {
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
        cmd.args(mode).args(extra);
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
        let model = Linear::new(4, 3, true, &InitKey::new(0))?;
        let mut m = FullyShardedDataParallel::new(Box::new(model), pg, FsdpConfig::default())?;
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
