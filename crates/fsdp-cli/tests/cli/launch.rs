//! `fsdp launch` as torchrun: one process per rank with torchrun's variables, the tcp backend
//! between them, and losses bit-identical to the thread-rank run of the same options; a
//! failing rank stops the job with one line naming it; bad arguments are clear errors.

use crate::common;
#[cfg(target_os = "linux")]
mod orphans;
#[cfg(unix)]
mod restarts;
use crate::support;

use std::path::PathBuf;
use std::process::{Command, Output};
use support::{corpus, processes_with, small_job};

fn fsdp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-launch-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "panic: {err}");
    out
}

fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The printed `step N | loss X` values.
fn printed_losses(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step") && l.contains("| loss"))
        .filter_map(|l| l.split('|').nth(1).map(|s| s.trim().to_string()))
        .collect()
}

/// The per-step losses and eval losses of a `--metrics` file, exactly as written (f32
/// shortest round-trip text).
fn metric_losses(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            format!("{} {} {}", v["step"], v["loss"], v["eval_loss"])
        })
        .collect()
}

#[test]
fn launched_processes_train_bit_identically_to_thread_ranks() {
    let dir = tmp_dir("parity");
    let data = corpus(&dir);
    let job = small_job(&data, 20);
    let (m_threads, m_launch) = (dir.join("threads.jsonl"), dir.join("launch.jsonl"));
    let threads = ok(fsdp()
        .args(&job)
        .args(["--world-size", "2", "--metrics"])
        .arg(&m_threads));
    let launched = ok(fsdp()
        .args(["launch", "--nproc-per-node", "2", "--", "fsdp"])
        .args(&job)
        .args(["--world-size", "2", "--metrics"])
        .arg(&m_launch));
    assert!(
        launched.contains("2 ranks (processes, tcp backend)"),
        "{launched}"
    );
    // Rank 0 alone prints: one line per step.
    assert_eq!(printed_losses(&launched).len(), 20, "{launched}");
    assert_eq!(printed_losses(&launched), printed_losses(&threads));
    let (a, b) = (metric_losses(&m_threads), metric_losses(&m_launch));
    assert_eq!(a.len(), 20);
    assert_eq!(a, b, "losses differ between thread ranks and processes");
    // Without --world-size, WORLD_SIZE decides.
    let m3 = dir.join("launch-default.jsonl");
    ok(fsdp()
        .args(["launch", "--nproc_per_node", "2", "--", "fsdp"])
        .args(&job)
        .arg("--metrics")
        .arg(&m3));
    assert_eq!(metric_losses(&m3), a);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_launched_checkpoint_resumes_on_thread_ranks_and_continues_the_curve() {
    let dir = tmp_dir("ckpt");
    let data = corpus(&dir);
    let save = dir.join("save");
    ok(fsdp()
        .args(["launch", "--nproc-per-node", "2", "--", "fsdp"])
        .args(small_job(&data, 6))
        .args(["--save-every", "3", "--save-dir"])
        .arg(&save));
    let step3 = save.join("step-00000003");
    let files: Vec<String> = std::fs::read_dir(&step3)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for want in [
        "index.json",
        "rank-00000-g1.safetensors",
        "rank-00001-g1.safetensors",
    ] {
        assert!(files.iter().any(|f| f == want), "{want} missing: {files:?}");
    }
    // The job uses its --steps for the warm-up cap: resume a run of 6 at step 3.
    let whole = ok(fsdp().args(small_job(&data, 6)).args(["--world-size", "2"]));
    let resumed = ok(fsdp()
        .args(small_job(&data, 6))
        .args(["--world-size", "2", "--resume"])
        .arg(&step3));
    assert_eq!(printed_losses(&resumed), printed_losses(&whole)[3..]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the FSDP_FAIL_RANK hook: cargo test --features test-hooks"
)]
fn a_failing_rank_stops_the_job_with_one_line_naming_it() {
    let dir = tmp_dir("fail");
    let data = corpus(&dir);
    for (rank, step) in [(1, 3), (0, 2)] {
        let out = run(fsdp()
            .args(["launch", "--nproc-per-node", "2", "--", "fsdp"])
            .args(small_job(&data, 10))
            .env("FSDP_FAIL_RANK", format!("{rank}:{step}")));
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.trim_end().lines().last().unwrap_or_default();
        assert!(
            last.starts_with(&format!(
                "error: fsdp launch: rank {rank} failed: exit code 1"
            )),
            "{err}"
        );
        assert!(last.contains("failure injected at step"), "{last}");
    }
    // Any program: the exit status is reported, the others are stopped (this one would
    // sleep for a minute).
    let out = run(fsdp().args([
        "launch",
        "--nproc-per-node",
        "3",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 2 ]; then exit 7; fi; exec sleep 60",
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("fsdp launch: rank 2 failed: exit code 7"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn children_get_torchruns_variables() {
    let out = ok(fsdp().args([
        "launch",
        "--nproc-per-node",
        "2",
        "--nnodes",
        "3",
        "--node-rank",
        "1",
        "--master-port",
        "1",
        "--rdzv-id",
        "my-job",
        "--",
        "sh",
        "-c",
        "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT $FSDP_JOB_ID $TORCHELASTIC_RUN_ID ${#FSDP_JOB_SECRET}",
    ])
    .env("FSDP_JOB_SECRET", "a secret of 24 characters"));
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort_unstable();
    assert_eq!(
        lines,
        [
            "2 0 6 2 1 127.0.0.1 1 my-job my-job 25",
            "3 1 6 2 1 127.0.0.1 1 my-job my-job 25"
        ]
    );
    // One node without a secret or an id: a fresh random secret (64 hex digits) and an id
    // derived from it, the same for every rank and different for every launch.
    let job = || {
        let out = ok(fsdp().args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "echo $FSDP_JOB_ID $FSDP_JOB_SECRET",
        ]));
        let lines: Vec<String> = out.lines().map(str::to_string).collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert_eq!(lines[0], lines[1], "both ranks get the same job");
        let (id, secret) = lines[0].split_once(' ').unwrap();
        assert!(id.starts_with("job-") && id.len() == 20, "{id}");
        assert_eq!(secret.len(), 64);
        assert!(secret.chars().all(|c| c.is_ascii_hexdigit()));
        lines[0].clone()
    };
    assert_ne!(job(), job());
}

#[test]
fn bad_launch_arguments_are_clear_errors() {
    let cases: [(&[&str], &str); 8] = [
        (
            &["--nproc-per-node", "0", "--", "true"],
            "--nproc-per-node must be at least 1",
        ),
        (
            &["--nproc-per-node", "2"],
            "required arguments were not provided",
        ),
        (
            &["--", "/nonexistent/program"],
            "starting '/nonexistent/program' for rank 0",
        ),
        (
            &["--nnodes", "2", "--", "true"],
            "--nnodes 2 needs --master-port",
        ),
        (
            &[
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--master-port",
                "5",
                "--",
                "true",
            ],
            "--node-rank 2 must be below --nnodes 2",
        ),
        (
            &["--nproc-per-node", "x", "--", "true"],
            "invalid value 'x'",
        ),
        (
            &["--nnodes", "2", "--master-port", "5", "--", "true"],
            "--nnodes 2 needs a job secret shared by every node: set FSDP_JOB_SECRET",
        ),
        (
            &["--rdzv-id", "a b", "--", "true"],
            "job id 'a b' holds ' '",
        ),
    ];
    for (args, want) in cases {
        let out = run(fsdp().arg("launch").args(args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(err.contains(want), "{args:?}: expected '{want}' in: {err}");
    }
    // --world-size against WORLD_SIZE, before any rendezvous.
    let out = run(fsdp()
        .args(["train", "--world-size", "3"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "1"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(
            "[rank 0] error: invalid argument: --world-size 3 differs from WORLD_SIZE=2"
        ),
        "one line, prefixed with the rank: {err}"
    );
    // A short secret is refused without being shown.
    let out = run(fsdp()
        .args(["launch", "--", "true"])
        .env("FSDP_JOB_SECRET", "tiny-secret"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("must be at least 16 characters; this one has 11"),
        "{err}"
    );
    assert!(!err.contains("tiny-secret"), "{err}");
}

/// The lines of `stderr` that report an error.
fn error_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains("error")).collect()
}

#[test]
fn failing_ranks_give_one_clean_line_per_distinct_error() {
    // Every rank fails alike: one line, naming the ranks. The data file is named first,
    // before the default --global-batch 64 that does not split over 3 ranks.
    let out = run(fsdp().args([
        "launch",
        "--nproc-per-node",
        "3",
        "--",
        "fsdp",
        "train",
        "--data",
        "/nonexistent/corpus.txt",
    ]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    let l = lines[0];
    assert!(
        l.starts_with("error: fsdp launch: rank ") && l.contains(" failed: exit code 1"),
        "{l}"
    );
    assert!(
        l.contains("cannot read data file '/nonexistent/corpus.txt'"),
        "{l}"
    );
    let root: usize = l["error: fsdp launch: rank ".len()..]
        .split(' ')
        .next()
        .and_then(|r| r.parse().ok())
        .unwrap();
    let others: Vec<String> = (0..3)
        .filter(|&r| r != root)
        .map(|r| r.to_string())
        .collect();
    assert!(
        l.ends_with(&format!(
            "; ranks {} failed with the same error",
            others.join(", ")
        )),
        "{l}"
    );
    assert!(!err.contains("error: error:"), "{err}");
    // Arguments that do not parse: clap's reason reaches the summary (exit code 2).
    let out = run(fsdp().args([
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "fsdp",
        "train",
        "--bogus-option",
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains(" failed: exit code 2 (")
            && lines[0].contains("unexpected argument '--bogus-option' found")
            && lines[0].ends_with("failed with the same error"),
        "{err}"
    );
    // Ranks that fail differently: the root cause in the summary, every other rank's own
    // error on one line of its own.
    let bin = env!("CARGO_BIN_EXE_fsdp");
    let out = run(fsdp().args([
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        &format!("exec {bin} train --data /nonexistent/rank-$RANK.txt"),
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 2, "{err}");
    let root = if lines[1].contains("rank 0 failed") {
        0
    } else {
        1
    };
    let other = 1 - root;
    assert_eq!(
        lines[0],
        format!(
            "[rank {other}] error: data: cannot read data file '/nonexistent/rank-{other}.txt': No such file or directory (os error 2) (run scripts/get_data.sh to fetch tinyshakespeare)"
        ),
        "{err}"
    );
    assert!(
        lines[1].starts_with(&format!(
            "error: fsdp launch: rank {root} failed: exit code 1"
        )) && lines[1].contains(&format!("/nonexistent/rank-{root}.txt"))
            && lines[1].ends_with(&format!("(ranks [{other}] also ended)")),
        "{err}"
    );
}

#[test]
fn two_jobs_on_one_port_never_mix_exactly_one_fails_naming_the_port() {
    let dir = tmp_dir("two-jobs");
    let data = corpus(&dir);
    // Long enough (a few seconds) that the two jobs overlap.
    let mut job = small_job(&data, 1000);
    let at = job.iter().position(|a| a == "--log-every").unwrap();
    job[at + 1] = "100".into();
    let expected = printed_losses(&ok(fsdp().args(&job).args(["--world-size", "2"])));
    assert_eq!(expected.len(), 11);
    for _ in 0..2 {
        let port = common::free_port().to_string();
        let start = || {
            fsdp()
                .args(["launch", "--nproc-per-node", "2", "--master-port", &port])
                .args(["--", "fsdp"])
                .args(&job)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (a, b) = (start(), start());
        let outs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];
        let ok: Vec<&Output> = outs.iter().filter(|o| o.status.success()).collect();
        let failed: Vec<&Output> = outs.iter().filter(|o| !o.status.success()).collect();
        assert_eq!(
            (ok.len(), failed.len()),
            (1, 1),
            "exactly one job fails: {:?}",
            outs.iter()
                .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
                .collect::<Vec<_>>()
        );
        // The other ran to completion, as alone.
        let stdout = String::from_utf8_lossy(&ok[0].stdout);
        assert_eq!(printed_losses(&stdout), expected, "{stdout}");
        let err = String::from_utf8_lossy(&failed[0].stderr);
        assert!(!err.contains("panicked"), "{err}");
        // The root cause is the loser's rank 0, which cannot host its store.
        let last = err.trim_end().lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: fsdp launch: rank 0 failed: ")
                && last.contains(&format!("port {port} on 127.0.0.1 is in use"))
                && last.contains("another job"),
            "{err}"
        );
        assert!(printed_losses(&String::from_utf8_lossy(&failed[0].stdout)).is_empty());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unreachable_master_addr_fails_within_seconds_naming_it() {
    let dir = tmp_dir("unreachable");
    let data = corpus(&dir);
    // A TEST-NET-3 address (never this machine's) and a name that never resolves.
    for addr in ["203.0.113.1", "no-such-host.invalid"] {
        let t = std::time::Instant::now();
        let out = run(fsdp()
            .args(["launch", "--nproc-per-node", "2", "--master-addr", addr])
            .args(["--", "fsdp"])
            .args(small_job(&data, 2)));
        let secs = t.elapsed().as_secs_f64();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.trim_end().lines().last().unwrap_or_default();
        assert!(secs < 15.0, "{addr}: {secs:.1} s: {err}");
        assert!(
            last.starts_with("error: fsdp launch: rank ") && last.contains(addr),
            "{err}"
        );
        // Rank 0 cannot host the store there; rank 1 may find no route to it first.
        let wants: &[&str] = if addr.starts_with("203") {
            &[
                "203.0.113.1 is not an address of this machine",
                "cannot reach the store at 203.0.113.1:",
            ]
        } else {
            &["'no-such-host.invalid' does not resolve"]
        };
        assert!(wants.iter().any(|w| last.contains(w)), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
#[test]
fn sigterm_to_the_launcher_reaches_every_rank() {
    let dir = tmp_dir("sigterm");
    let data = corpus(&dir);
    // A unique data path marks this job's processes.
    let job = small_job(&data, 1_000_000);
    let child = fsdp()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--",
            "fsdp",
        ])
        .args(&job)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until both ranks run (the launcher's own command line holds the path too).
    let start = std::time::Instant::now();
    while processes_with(&data) < 3 && start.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(processes_with(&data), 3, "launcher and 2 ranks running");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("received SIGTERM"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let start = std::time::Instant::now();
    while processes_with(&data) > 0 && start.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        processes_with(&data),
        0,
        "ranks left running after the launcher"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A second job started on a busy port: its rank 1 reaches the first job's store and is
/// refused (another job id), its rank 0 cannot host the store (the port is in use). The
/// summary blames rank 0, the root cause, even when rank 1 failed first (here rank 0
/// starts only once rank 1 has recorded its error); rank 1's error gets its own line.
#[cfg(unix)]
#[test]
fn a_busy_port_blames_rank_0s_store_failure_even_when_rank_1_fails_first() {
    let dir = tmp_dir("busy-port");
    let data = corpus(&dir);
    let port = common::free_port().to_string();
    let launch = |n: &str| {
        let mut c = fsdp();
        c.args([
            "launch",
            "--nproc-per-node",
            n,
            "--master-port",
            &port,
            "--",
        ]);
        c
    };
    let first = launch("1")
        .args(["fsdp"])
        .args(small_job(&data, 1_000_000))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Until the first job's store listens (a connection it refuses, once).
    let addr = format!("127.0.0.1:{port}");
    for _ in 0..1200 {
        if std::net::TcpStream::connect(&addr).is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let wait_for_rank_1 = r#"if [ "$RANK" = 0 ]; then d=$(dirname "$TORCHELASTIC_ERROR_FILE"); while [ ! -s "$d/error-rank-1.json" ]; do sleep 0.02; done; fi; exec "$0" "$@""#;
    let out = run(launch("2")
        .args(["sh", "-c", wait_for_rank_1, env!("CARGO_BIN_EXE_fsdp")])
        .args(small_job(&data, 5)));
    // SAFETY: kill(2) on our own child; the launcher passes SIGTERM on to its rank.
    unsafe { libc::kill(first.id() as libc::pid_t, libc::SIGTERM) };
    let _ = first.wait_with_output();
    let err = String::from_utf8_lossy(&out.stderr);
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[0].starts_with("[rank 1] error: init_process_group")
            && lines[0].contains(&format!("TCPStore at {addr} (rank 1): it belongs to job")),
        "{err}"
    );
    assert!(
        lines[1].starts_with("error: fsdp launch: rank 0 failed: exit code 1")
            && lines[1].contains(&format!("TCPStore: port {port} on 127.0.0.1 is in use"))
            && lines[1].ends_with("; the job was stopped (ranks [1] also ended)"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
