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
