//! A launcher killed outright (`kill -9`: the OOM killer, a scheduler's preemption) takes
//! its ranks with it: none is left training under PID 1, including a rank blocked in a
//! collective because a peer was stopped.

use super::{corpus, fsdp, small_job, tmp_dir};
use std::io::BufRead;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The processes whose command line holds `token`, with their `RANK` variable (`None` for
/// the launcher, which has none). Zombies have an empty command line and are not listed.
fn job_processes(token: &str) -> Vec<(i32, Option<usize>)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        if !String::from_utf8_lossy(&cmdline).contains(token) {
            return None;
        }
        let environ = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let rank = environ
            .split(|&b| b == 0)
            .filter_map(|v| std::str::from_utf8(v).ok()?.strip_prefix("RANK="))
            .find_map(|r| r.parse().ok());
        Some((pid, rank))
    })
    .collect()
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a process of this test's job.
    unsafe { libc::kill(pid, sig) };
}

/// Kills `fsdp launch` of an `n`-process job with SIGKILL once it trains (after `stop`'s
/// rank was stopped with SIGSTOP, so that the others block in their next collective), and
/// checks that no rank is left 5 s later. Leftovers are killed before the test fails.
fn no_rank_outlives_its_killed_launcher(n: usize, stop: Option<usize>) {
    let dir = tmp_dir(&format!("orphans-{n}-{stop:?}"));
    // The unique data path marks this job's processes.
    let data = corpus(&dir);
    let mut launcher = fsdp()
        .args(["launch", "--nproc-per-node", &n.to_string(), "--", "fsdp"])
        .args(small_job(&data, 1_000_000))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Rank 0's step lines, as they come.
    let (tx, rx) = mpsc::channel();
    let stdout = launcher.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.starts_with("step") && tx.send(line).is_err() {
                break;
            }
        }
    });
    // Mid-training: every rank has joined and rank 0 has logged steps.
    for _ in 0..3 {
        rx.recv_timeout(Duration::from_secs(120))
            .expect("the job logs its first steps");
    }
    let ranks: Vec<(i32, Option<usize>)> = job_processes(&data)
        .into_iter()
        .filter(|(_, r)| r.is_some())
        .collect();
    assert_eq!(ranks.len(), n, "{n} ranks running: {ranks:?}");
    if let Some(s) = stop {
        let (pid, _) = ranks.iter().find(|(_, r)| *r == Some(s)).unwrap();
        signal(*pid, libc::SIGSTOP);
        // The job stalls: no step completes without rank `s`, so the other ranks wait in a
        // collective (rank 0 may finish the step it was in).
        let t = Instant::now();
        while rx.recv_timeout(Duration::from_millis(500)).is_ok() {
            assert!(t.elapsed() < Duration::from_secs(60), "the job goes on");
        }
    }
    signal(launcher.id() as i32, libc::SIGKILL);
    let _ = launcher.wait();
    let start = Instant::now();
    let mut left = job_processes(&data);
    while !left.is_empty() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
        left = job_processes(&data);
    }
    for (pid, _) in &left {
        signal(*pid, libc::SIGKILL);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        left.is_empty(),
        "{n} ranks{}: processes (pid, RANK) left 5 s after the launcher was killed: {left:?}",
        stop.map_or(String::new(), |s| format!(", rank {s} stopped"))
    );
}

#[test]
fn killing_the_launcher_of_2_ranks_leaves_no_rank_running() {
    no_rank_outlives_its_killed_launcher(2, None);
}

#[test]
fn killing_the_launcher_of_4_ranks_leaves_no_rank_running() {
    no_rank_outlives_its_killed_launcher(4, None);
}

#[test]
fn ranks_blocked_in_a_collective_die_with_their_launcher() {
    no_rank_outlives_its_killed_launcher(4, Some(2));
}

/// Connections to local port `port` in state ESTABLISHED (`/proc/net/tcp`, both ends when
/// they are on this machine).
fn established_to(port: u16) -> usize {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let want = format!(":{port:04X}");
    text.lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1].ends_with(&want) && f[3] == "01"
        })
        .count()
}

/// Rank 1 of a world of 3 waits at rank 0's store for rank 2, which never comes; rank 0 is
/// killed: rank 1 ends at once, naming the store it lost and its host, not a timeout.
#[test]
fn a_rank_that_loses_the_rendezvous_store_names_it() {
    let dir = tmp_dir("store-lost");
    let data = corpus(&dir);
    let port = super::common::free_port();
    // 6 rows: a batch 3 ranks split.
    let mut job = small_job(&data, 5);
    let at = job.iter().position(|a| a == "--global-batch").unwrap();
    job[at + 1] = "6".into();
    let rank = |r: &str| {
        let mut c = fsdp();
        c.args(&job)
            .env("RANK", r)
            .env("WORLD_SIZE", "3")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("FSDP_JOB_SECRET", "a secret of 24 characters")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };
    let mut r0 = rank("0");
    let r1 = rank("1");
    // Rank 0's own client and rank 1's connection, both accepted by the store.
    let t = Instant::now();
    while established_to(port) < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "rank 1 never connected"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Past its handshake and into the wait for rank 2 (milliseconds of work; should it be
    // slower, it loses the store in a request before the wait, which the assertions below
    // take too).
    std::thread::sleep(Duration::from_secs(1));
    r0.kill().unwrap();
    let _ = r0.wait();
    let out = r1.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    assert!(!err.contains("timed out"), "{err}");
    // Lost while waiting for rank 2 (or, when rank 0 died sooner, in the store request
    // before that wait): the store's address and the rank either way.
    assert!(
        err.contains(&format!("TCPStore at 127.0.0.1:{port} (rank 1)")),
        "{err}"
    );
    if err.contains("wait(") {
        assert!(
            err.starts_with(&format!(
                "[rank 1] error: rank 0 failed: init_process_group (rendezvous '127.0.0.1:{port}') on rank 1: lost the rendezvous store that rank 0 hosts, while waiting for "
            )),
            "{err}"
        );
    }
}
