//! `fsdp launch --max-restarts`: the group of local ranks starts again after a failure, at
//! a fresh rendezvous round with torchrun's restart count; with `fsdp train
//! --resume-if-present` the job goes on from its last checkpoint and its curve and metrics
//! file are those of an uninterrupted run.

use super::{corpus, fsdp, metric_losses, ok, printed_losses, run, small_job, tmp_dir};

/// The `fsdp launch: ... restarting` lines of `stderr`.
fn restart_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("fsdp launch: ") && l.contains("; restarting the "))
        .collect()
}

#[test]
fn every_round_gets_the_restart_count_and_its_own_rendezvous_id() {
    // Rounds 0 and 1 fail, round 2 succeeds.
    let script = r#"echo "$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $FSDP_JOB_ID $TORCHELASTIC_RUN_ID $RANK"; [ "$TORCHELASTIC_RESTART_COUNT" = 2 ] || exit 3"#;
    let launch = |max: &str| {
        run(fsdp()
            .args(["launch", "--nproc-per-node", "2", "--rdzv-id", "my-job"])
            .args(["--max-restarts", max, "--", "sh", "-c", script]))
    };
    let out = launch("2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    lines.sort_unstable();
    assert_eq!(
        lines,
        [
            "0 2 my-job my-job 0",
            "0 2 my-job my-job 1",
            "1 2 my-job:restart-1 my-job 0",
            "1 2 my-job:restart-1 my-job 1",
            "2 2 my-job:restart-2 my-job 0",
            "2 2 my-job:restart-2 my-job 1",
        ]
    );
    let restarts = restart_lines(&err);
    assert_eq!(restarts.len(), 2, "{err}");
    for (i, l) in restarts.iter().enumerate() {
        let n = i + 1;
        assert!(
            l.contains(" failed: exit code 3")
                && l.ends_with(&format!(
                    "; restarting the 2 local ranks (restart {n} of 2, rendezvous round {n})"
                )),
            "{err}"
        );
    }
    // One restart is not enough: the last round's failure, after the restart.
    let out = launch("1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(restart_lines(&err).len(), 1, "{err}");
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: fsdp launch: rank ")
            && last.contains(" failed: exit code 3")
            && last.ends_with("(after 1 restart, --max-restarts 1)"),
        "{err}"
    );
    // Without --max-restarts: no restart.
    let out = launch("0");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && restart_lines(&err).is_empty(),
        "{err}"
    );
    assert!(!err.contains("after"), "{err}");
}

/// The step `resumed from DIR (after step N)` names in `stdout`, and DIR.
fn resumed_after(stdout: &str) -> Vec<(usize, String)> {
    stdout
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("resumed from ")?;
            let (dir, step) = rest.rsplit_once(" (after step ")?;
            Some((step.strip_suffix(')')?.parse().ok()?, dir.to_string()))
        })
        .collect()
}

#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the FSDP_KILL_ONCE hook: cargo test --features test-hooks"
)]
fn a_rank_killed_mid_run_restarts_from_the_last_checkpoint_and_the_curve_is_unchanged() {
    let dir = tmp_dir("restart");
    let data = corpus(&dir);
    let (steps, save_every, kill_at) = (12, 4, 7);
    let job = small_job(&data, steps);
    let save = dir.join("save");
    let metrics = dir.join("job.jsonl");
    let marker = dir.join("killed");
    let out = run(fsdp()
        .args(["launch", "--nproc-per-node", "2", "--max-restarts", "1"])
        .args(["--", "fsdp"])
        .args(&job)
        .args(["--save-every", &save_every.to_string(), "--keep-last", "10"])
        .arg("--save-dir")
        .arg(&save)
        .arg("--metrics")
        .arg(&metrics)
        .arg("--resume-if-present")
        .env(
            "FSDP_KILL_ONCE",
            format!("1:{kill_at}:{}", marker.display()),
        ));
    let (stdout, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{err}");
    assert!(marker.exists(), "rank 1 was killed");
    // One restart, blaming rank 1's SIGKILL.
    let restarts = restart_lines(&err);
    assert_eq!(restarts.len(), 1, "{err}");
    assert!(
        restarts[0].starts_with("fsdp launch: rank 1 failed: signal 9 (SIGKILL)"),
        "{err}"
    );
    // The first round started fresh, the second resumed from the last checkpoint before
    // the kill: at most --save-every steps were lost.
    assert!(
        stdout.contains(&format!(
            "--resume-if-present: no checkpoint in {} yet, starting at step 1",
            save.display()
        )),
        "{stdout}"
    );
    let resumed = resumed_after(&stdout);
    assert_eq!(resumed.len(), 1, "{stdout}");
    let (from, ckpt) = resumed[0].clone();
    assert_eq!(from, 4, "{stdout}");
    assert!(kill_at - from <= save_every);
    // The metrics file: each step once, in order.
    let recorded = metric_losses(&metrics);
    let steps_seen: Vec<usize> = recorded
        .iter()
        .map(|l| l.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(steps_seen, (1..=steps).collect::<Vec<_>>(), "{recorded:?}");
    // From the restart on, bitwise the run resumed by hand from the same checkpoint (on
    // thread ranks, which train as the processes do); before it, the uninterrupted run's.
    let by_hand = dir.join("by-hand.jsonl");
    ok(fsdp()
        .args(&job)
        .args(["--world-size", "2", "--resume", &ckpt, "--metrics"])
        .arg(&by_hand));
    assert_eq!(recorded[from..], metric_losses(&by_hand)[..]);
    let whole = dir.join("whole.jsonl");
    let uninterrupted = ok(fsdp()
        .args(&job)
        .args(["--world-size", "2", "--metrics"])
        .arg(&whole));
    assert_eq!(recorded, metric_losses(&whole));
    // The printed curve: the steps before the kill, then again from the checkpoint on.
    let printed = printed_losses(&stdout);
    let expected = printed_losses(&uninterrupted);
    assert_eq!(printed[printed.len() - (steps - from)..], expected[from..]);
    let _ = std::fs::remove_dir_all(&dir);
}
