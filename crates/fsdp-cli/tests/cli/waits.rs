//! Waits that end, and say what they wait for: `--timeout` on `fsdp train` and `fsdp
//! launch` (bad values are one clear line), progress lines while a rank waits for a store
//! that is not there or never answers, and the heartbeat that names a stopped rank long
//! before the collective timeout, at no store request per step (`tcp` and `nccl`
//! backends).

use crate::common;

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "a-secret-for-the-wait-tests";

fn fsdp() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fsdp"));
    // One progress line a second, so that a 3 s wait shows some.
    c.env("FSDP_WAIT_PROGRESS", "1");
    c
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-waits-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `fsdp train` of a tiny model on a corpus in `dir` for `steps` steps.
fn train_args(dir: &Path, steps: usize) -> Vec<String> {
    let data = dir.join("corpus.txt");
    std::fs::write(&data, common::corpus(20_000)).unwrap();
    let mut args = vec![
        "train".to_string(),
        "--data".into(),
        data.display().to_string(),
    ];
    let rest = format!(
        "--steps {steps} --n-layer 1 --n-embd 16 --n-head 2 --global-batch 4 --seq-len 8 \
         --eval-every 0 --sample-len 0 --log-every 0"
    );
    args.extend(rest.split_whitespace().map(String::from));
    args
}

/// Runs `cmd` to its end; fails the test (killing it) when it outlives `limit`, a generous
/// bound far below the 300 s default timeout. Returns (success, stderr).
fn run_within(cmd: &mut Command, limit: Duration) -> (bool, String) {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = reader.join().unwrap();
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    (status.success(), stderr)
}

#[test]
fn bad_timeouts_are_one_clear_line() {
    for sub in [&["train"][..], &["launch", "--", "true"][..]] {
        for (opt, value, why) in [
            ("--timeout", "0", "must be above 0 seconds"),
            ("--timeout", "-5", "must be above 0 seconds"),
            ("--timeout", "soon", "is not a number of seconds"),
            ("--timeout", "inf", "is not a finite number of seconds"),
            ("--heartbeat-timeout", "0", "must be above 0 seconds"),
            ("--heartbeat-timeout", "0.1", "below the least"),
        ] {
            let mut args: Vec<&str> = vec![sub[0], opt, value];
            args.extend(&sub[1..]);
            let out = fsdp().args(&args).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
            assert!(err.contains(opt) && err.contains(why), "{args:?}: {err}");
        }
    }
}

#[test]
fn a_node_without_its_master_fails_at_the_timeout_naming_the_address_with_progress_lines() {
    let dir = tmp_dir("no-master");
    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let (ok, err) = run_within(
        fsdp()
            .args([
                "launch",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-port",
            ])
            .arg(port.to_string())
            .args(["--timeout", "3", "--"])
            .arg(env!("CARGO_BIN_EXE_fsdp"))
            .args(train_args(&dir, 2))
            .env("FSDP_JOB_SECRET", SECRET),
        Duration::from_secs(60),
    );
    assert!(!ok, "{err}");
    let progress: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("still waiting after"))
        .collect();
    assert!(
        !progress.is_empty()
            && progress.iter().all(|l| {
                l.starts_with("fsdp: rank 1 still waiting after")
                    && l.contains("(timeout 3 s): connecting to the TCPStore at ")
                    && !l.contains("))")
                    && l.contains(&addr)
                    && l.contains("nothing listens there")
            }),
        "{err}"
    );
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("timed out") && last.contains(&addr) && last.contains("3"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_listener_that_never_answers_is_a_timeout_naming_it() {
    let dir = tmp_dir("mute");
    // Connections complete in the kernel's backlog; nobody ever reads or writes them.
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = mute.local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let (ok, err) = run_within(
        fsdp()
            .args(train_args(&dir, 2))
            .args(["--timeout", "3"])
            .env("RANK", "1")
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string()),
        Duration::from_secs(60),
    );
    assert!(!ok, "{err}");
    assert!(
        err.lines().any(|l| l.contains("still waiting after")
            && l.contains(&addr)
            && l.contains("has not answered the job handshake")),
        "{err}"
    );
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains(&addr) && last.contains("did not answer"),
        "{err}"
    );
    drop(mute);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kill -SIG pid`.
fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a child this test started and has not reaped.
    unsafe { libc::kill(child.id() as i32, sig) };
}

#[cfg(unix)]
#[test]
fn a_stopped_rank_is_named_by_the_heartbeat_long_before_the_timeout() {
    a_stopped_rank_is_named("sigstop", &[], 100);
}

/// The same on the `nccl` backend (`--device cuda`: one process per rank meeting through
/// the store), on the GPUs of this machine or cuda-emu's (`scripts/cuda-emu.sh` runs it):
/// the heartbeat fails every group of the stopped rank's peers and aborts their
/// communicators, so the collective waiting for it ends. Skipped, saying so, without two
/// CUDA devices (NCCL refuses two ranks of one communicator on one GPU) or NCCL.
#[cfg(all(unix, feature = "cuda"))]
#[test]
fn nccl_a_stopped_rank_is_named_by_the_heartbeat_long_before_the_timeout() {
    match fsdp::backend::cuda::detect() {
        Ok(gpus) if gpus.len() >= 2 && fsdp::distributed::nccl::is_available() => {}
        other => {
            eprintln!(
                "skipping the NCCL heartbeat test: two CUDA devices and libnccl needed (devices: {:?}, libnccl: {})",
                other.map(|g| g.len()),
                fsdp::distributed::nccl::is_available()
            );
            return;
        }
    }
    // An emulated step is slower: 20 steps and 3 s of them.
    a_stopped_rank_is_named("nccl-sigstop", &["--device", "cuda"], 20);
}

/// Two rank processes (`RANK`, `WORLD_SIZE`, the store at `MASTER_ADDR:MASTER_PORT`) train
/// with `extra` arguments under `--heartbeat-timeout 2 --timeout 200` for at least 3 s (some
/// 7 beats) and `min_steps` steps; then rank 1 is stopped with SIGSTOP. Rank 0 must fail
/// naming rank 1's missing heartbeat long before the collective timeout, and its steps
/// after the first made no store request (the heartbeat has its own connection).
#[cfg(unix)]
fn a_stopped_rank_is_named(name: &str, extra: &[&str], min_steps: usize) {
    let dir = tmp_dir(name);
    let port = common::free_port().to_string();
    let metrics = dir.join("m.jsonl");
    let rank = |r: usize| {
        let mut c = fsdp();
        c.args(train_args(&dir, 1_000_000))
            .args(extra)
            .args(["--timeout", "200", "--heartbeat-timeout", "2"])
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("FSDP_JOB_SECRET", SECRET)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if r == 0 {
            c.arg("--metrics").arg(&metrics);
        }
        c.spawn().unwrap()
    };
    let mut r0 = rank(0);
    let mut r1 = rank(1);
    // Let it train a while, beating every 0.4 s, then stop rank 1.
    let steps = |p: &Path| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let start = Instant::now();
    let mut training: Option<Instant> = None;
    while training.is_none_or(|t| t.elapsed() < Duration::from_secs(3))
        || steps(&metrics) < min_steps
    {
        assert!(start.elapsed() < Duration::from_secs(120), "no progress");
        assert!(r0.try_wait().unwrap().is_none(), "rank 0 ended early");
        if training.is_none() && steps(&metrics) > 0 {
            training = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(&r1, libc::SIGSTOP);
    let stopped = Instant::now();
    let status = loop {
        if let Some(st) = r0.try_wait().unwrap() {
            break st;
        }
        if stopped.elapsed() > Duration::from_secs(100) {
            signal(&r1, libc::SIGKILL);
            let _ = r0.kill();
            panic!("rank 0 still waits 100 s after rank 1 stopped (heartbeat timeout 2 s)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "{name}: rank 0 ended {:.1} s after rank 1 stopped (heartbeat timeout 2 s, timeout 200 s)",
        stopped.elapsed().as_secs_f64()
    );
    signal(&r1, libc::SIGKILL);
    let _ = r1.wait();
    let mut err = String::new();
    r0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!status.success());
    assert!(
        err.contains("rank 1 sent no heartbeat for over 2.0 s"),
        "{err}"
    );
    // The heartbeat's requests are not the steps': none in any step after the first.
    let text = std::fs::read_to_string(&metrics).unwrap();
    for line in text.lines().skip(1) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["counters"]["store_ops"], 0, "{line}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
