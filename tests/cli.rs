//! `fsdp train` as a user runs it: bad input gives one line naming the problem and a
//! non-zero exit, never a panic; a small run prints losses, eval loss and a sample.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn fsdp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
}

fn tmp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fsdp-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Runs `fsdp train ARGS`, expects failure with a single stderr line containing `want`.
fn fails_with(args: &[&str], want: &str) {
    let out = fsdp().arg("train").args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: not one line: {err}"
    );
    assert!(err.contains(want), "{args:?}: expected '{want}' in: {err}");
}

/// A one-layer, 16-wide model on 16-token rows: seconds per run.
const TINY_MODEL: [&str; 8] = [
    "--seq-len",
    "16",
    "--n-layer",
    "1",
    "--n-embd",
    "16",
    "--n-head",
    "2",
];

#[test]
fn bad_input_is_one_line_and_a_non_zero_exit() {
    let text = tmp("ok.txt", common::corpus(5_000).as_bytes());
    let t = text.to_str().unwrap();
    let empty = tmp("empty.txt", b"");
    let binary = tmp("binary.bin", &[0x7f, b'E', b'L', b'F', 0, 0, 0xff, 0xfe]);
    let missing = text.with_file_name("does-not-exist.txt");
    fails_with(
        &["--data", missing.to_str().unwrap()],
        "cannot read data file",
    );
    fails_with(&["--data", empty.to_str().unwrap()], "is empty");
    fails_with(&["--data", binary.to_str().unwrap()], "not UTF-8 text");
    fails_with(
        &["--data", t, "--world-size", "3", "--global-batch", "32"],
        "multiple of --world-size 3",
    );
    fails_with(&["--data", t, "--steps", "0"], "--steps must be at least 1");
    fails_with(
        &["--data", t, "--strategy", "zero-3"],
        "invalid value 'zero-3' for '--strategy",
    );
    fails_with(&["--data", t, "--steps", "many"], "invalid value 'many'");
    fails_with(
        &["--data", t, "--lr", "-0.01"],
        "--lr must be a positive number, got -0.01",
    );
    fails_with(&["--data", t, "--metrics", t], "is the data file");
    // A hard link to the data file is the data file too.
    let link = text.with_file_name("hard-link.txt");
    let _ = std::fs::remove_file(&link);
    std::fs::hard_link(&text, &link).unwrap();
    fails_with(
        &["--data", t, "--metrics", link.to_str().unwrap()],
        "is the data file",
    );
    // A named pipe would block the run until someone reads it.
    let fifo = text.with_file_name("metrics.fifo");
    let _ = std::fs::remove_file(&fifo);
    if std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        fails_with(
            &["--data", t, "--metrics", fifo.to_str().unwrap()],
            "is a named pipe",
        );
    }
    fails_with(
        &["--data", t, "--clip-grad-norm", "-1"],
        "--clip-grad-norm must be a positive number, got -1",
    );
    fails_with(
        &["--data", t, "--grad-accum", "0"],
        "--grad-accum must be at least 1",
    );
    fails_with(
        &["--data", t, "--ranks-per-node", "2"],
        "--ranks-per-node applies to hybrid-shard",
    );
    fails_with(
        &[
            "--data",
            t,
            "--world-size",
            "4096",
            "--global-batch",
            "4096",
        ],
        "GiB of memory",
    );
    fails_with(
        &["--data", text.parent().unwrap().to_str().unwrap()],
        "is not a regular file",
    );
    fails_with(
        &["--data", t, "--n-embd", "65536", "--n-head", "4"],
        "GiB of memory",
    );
    fails_with(
        &[
            "--data",
            t,
            "--strategy",
            "hybrid-shard",
            "--world-size",
            "4",
            "--ranks-per-node",
            "3",
        ],
        "--ranks-per-node 3 must divide --world-size 4",
    );
}

#[test]
fn a_small_run_reports_losses_eval_and_a_sample() {
    let text = tmp("run.txt", common::corpus(20_000).as_bytes());
    let metrics = text.with_file_name("m.jsonl");
    let out = fsdp()
        .args([
            "train",
            "--data",
            text.to_str().unwrap(),
            "--world-size",
            "2",
            "--steps",
            "6",
            "--global-batch",
            "4",
        ])
        .args(TINY_MODEL)
        .args(["--eval-every", "3", "--sample-len", "20"])
        .args(["--metrics", metrics.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("eval loss"), "{stdout}");
    assert!(stdout.contains("--- sample ---"), "{stdout}");
    assert!(stdout.contains("rank 1:"), "{stdout}");
    assert_eq!(std::fs::read_to_string(metrics).unwrap().lines().count(), 6);
}

#[test]
fn a_failing_rank_ends_the_job_promptly_with_one_line_naming_it() {
    let text = tmp("fail.txt", common::corpus(20_000).as_bytes());
    let run = |fail: &str| {
        let start = std::time::Instant::now();
        let out = fsdp()
            .env("FSDP_FAIL_RANK", fail)
            .args(["train", "--data", text.to_str().unwrap()])
            .args(["--world-size", "3", "--steps", "5", "--global-batch", "6"])
            .args(TINY_MODEL)
            .args(["--sample-len", "0"])
            .output()
            .unwrap();
        (out, start.elapsed())
    };
    let (out, elapsed) = run("2:3");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {err}");
    // Peers stop at once instead of waiting out the 300 s collective timeout.
    assert!(
        elapsed < std::time::Duration::from_secs(60),
        "took {elapsed:?}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    assert_eq!(
        err.trim_end(),
        "error: rank 2 failed: fsdp: failure injected at step 3 by FSDP_FAIL_RANK=2:3"
    );
    let (out, _) = run("3");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("FSDP_FAIL_RANK='3': rank 3 is not below --world-size 3"),
        "{err}"
    );
}

#[test]
fn fsdp_options_run_from_the_command_line_and_bad_values_are_named() {
    let text = tmp("options.txt", common::corpus(20_000).as_bytes());
    let t = text.to_str().unwrap();
    fails_with(
        &["--data", t, "--mixed-precision", "fp8"],
        "invalid value 'fp8' for '--mixed-precision",
    );
    fails_with(
        &["--data", t, "--backward-prefetch", "sideways"],
        "invalid value 'sideways' for '--backward-prefetch",
    );
    fails_with(
        &["--data", t, "--limit-all-gathers", "maybe"],
        "invalid value 'maybe' for '--limit-all-gathers",
    );
    let run = |extra: &[&str]| {
        let out = fsdp()
            .args(["train", "--data", t, "--world-size", "2", "--steps", "3"])
            .args([
                "--global-batch",
                "4",
                "--sample-len",
                "0",
                "--log-every",
                "1",
            ])
            .args(TINY_MODEL)
            .args(extra)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{extra:?}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .filter(|l| l.starts_with("step") && l.contains("| loss"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let losses = |lines: Vec<String>| -> Vec<String> {
        lines
            .iter()
            .map(|l| l.split('|').nth(1).unwrap_or("").trim().to_string())
            .collect()
    };
    let base = losses(run(&[]));
    assert_eq!(base.len(), 3, "{base:?}");
    // Prefetch and offload move data differently, never change a number.
    let moved = losses(run(&[
        "--backward-prefetch",
        "post",
        "--forward-prefetch",
        "--limit-all-gathers",
        "false",
        "--cpu-offload",
    ]));
    assert_eq!(moved, base);
    let bf16 = losses(run(&["--mixed-precision", "bf16"]));
    assert_eq!(bf16.len(), 3);
}

/// `--device cuda` without a usable GPU: one line saying why, non-zero exit, before any
/// work. Which line depends on the build and machine: no `cuda` feature, no driver
/// (`libcuda.so`), no device. On a machine with a GPU there is nothing to check here
/// (tests/fsdp_cuda.rs trains on it).
#[test]
fn device_cuda_without_a_gpu_is_one_line_and_a_non_zero_exit() {
    if fsdp::backend::cuda::detect().is_ok() {
        eprintln!("skipping: this machine has a usable GPU");
        return;
    }
    let text = tmp("cuda.txt", common::corpus(5_000).as_bytes());
    let out = fsdp()
        .args(["train", "--device", "cuda", "--steps", "1", "--data"])
        .arg(&text)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "--device cuda succeeded: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    let known = [
        "this build has no CUDA support",
        "no CUDA driver found (libcuda.so)",
        "no CUDA device",
        "initializing the CUDA driver",
        "training on CUDA tensors",
    ];
    assert!(
        known.iter().any(|k| err.contains(k)),
        "unexpected message: {err}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).is_empty(),
        "started training: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
