//! init_process_group from torchrun-like variables (maps, never the real process env: tests
//! run in parallel), the per-thread default group, and their error cases.

use crate::common::on_threads;
use fsdp::distributed::{
    default_group, destroy_process_group, get_backend, get_local_world_size, get_node_local_rank,
    get_rank, get_world_size, init_process_group, is_initialized, launch, InitOptions,
    LaunchOptions, ReduceOp,
};
use fsdp::tensor::Tensor;
use fsdp::Error;
use std::time::{Duration, Instant};

/// What torchrun sets for rank `rank` of `world` on nodes of `per_node` ranks.
fn torchrun_env(
    addr: &str,
    world: usize,
    rank: usize,
    per_node: usize,
) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", (rank % per_node).to_string()),
        ("LOCAL_WORLD_SIZE", per_node.to_string()),
        ("MASTER_ADDR", addr.to_string()),
        ("MASTER_PORT", "29500".to_string()),
    ]
}

#[test]
fn threads_with_torchrun_variables_join_one_world() {
    for round in 0..2 {
        // The same address twice: a finished rendezvous frees its key.
        let out = on_threads(4, |r| {
            let opts = InitOptions::new("threads")
                .with_env(torchrun_env("init-env-world", 4, r, 2))
                .with_timeout(Duration::from_secs(10));
            let world = init_process_group(opts)?;
            assert!(is_initialized());
            let t = Tensor::from_vec(vec![r as f32], &[1])?;
            default_group()?.all_reduce(&t, ReduceOp::Sum)?;
            let seen = (
                get_rank()?,
                get_world_size()?,
                get_node_local_rank()?,
                get_local_world_size()?,
                get_backend()?,
                world.rank(),
                t.to_vec_f32()?[0],
            );
            destroy_process_group()?;
            assert!(!is_initialized());
            assert!(matches!(
                get_rank(),
                Err(Error::NotInitialized { call: "get_rank" })
            ));
            Ok(seen)
        });
        for (r, res) in out.into_iter().enumerate() {
            assert_eq!(
                res.unwrap(),
                (r, 4, r % 2, 2, "threads", r, 6.0),
                "round {round}"
            );
        }
    }
}

#[test]
fn explicit_arguments_override_the_environment() {
    let opts = InitOptions {
        world_size: Some(8),
        rank: Some(5),
        init_method: Some("tcp://10.1.2.3:1234".into()),
        ..InitOptions::new("THREADS").with_env(torchrun_env("ignored", 2, 1, 1))
    };
    let rv = opts.resolve().unwrap();
    assert_eq!(
        (rv.key.as_str(), rv.world_size, rv.rank),
        ("10.1.2.3:1234", 8, 5)
    );
    assert_eq!((rv.local_rank, rv.local_world_size), (Some(0), Some(1)));
    assert_eq!(
        rv.timeout,
        Duration::from_secs(300),
        "torch's default timeout"
    );
    let rv = InitOptions::new("threads")
        .with_env(torchrun_env("node0", 4, 3, 4))
        .resolve()
        .unwrap();
    assert_eq!((rv.key.as_str(), rv.rank), ("node0:29500", 3));
    let rv = InitOptions::threads("my-world", 2, 1).resolve().unwrap();
    assert_eq!(
        (rv.key.as_str(), rv.local_rank),
        ("threads://my-world", None)
    );
}

#[test]
fn bad_torchrun_variables_are_errors_naming_the_variable_and_value() {
    let base = |skip: &str, set: &[(&'static str, &str)]| {
        let mut env: Vec<(&'static str, String)> = torchrun_env("a", 4, 1, 2)
            .into_iter()
            .filter(|(k, _)| *k != skip)
            .collect();
        for (k, v) in set {
            env.retain(|(e, _)| e != k);
            env.push((k, v.to_string()));
        }
        InitOptions::new("threads").with_env(env)
    };
    let cases: Vec<(InitOptions, &str)> = vec![
        (base("WORLD_SIZE", &[]), "WORLD_SIZE is not set"),
        (base("RANK", &[]), "RANK is not set"),
        (
            base("", &[("WORLD_SIZE", "four")]),
            "WORLD_SIZE='four' is not an integer >= 1",
        ),
        (
            base("", &[("WORLD_SIZE", "0")]),
            "WORLD_SIZE='0' is not an integer >= 1",
        ),
        (
            base("", &[("RANK", "-1")]),
            "RANK='-1' is not an integer >= 0",
        ),
        (
            base("", &[("RANK", "4")]),
            "rank 4 (from RANK) is not below the world size 4 (from WORLD_SIZE)",
        ),
        (base("", &[("LOCAL_RANK", "x")]), "LOCAL_RANK='x'"),
        (
            base("", &[("LOCAL_RANK", "2")]),
            "local rank 2 (LOCAL_RANK) is not below the local world size 2",
        ),
        (
            base("", &[("LOCAL_WORLD_SIZE", "8")]),
            "local world size 8 (LOCAL_WORLD_SIZE) must be in 1..=4",
        ),
        (base("MASTER_ADDR", &[]), "MASTER_ADDR, which is not set"),
        (
            base("", &[("MASTER_ADDR", " ")]),
            "MASTER_ADDR, which is not set",
        ),
        (base("MASTER_PORT", &[]), "MASTER_PORT, which is not set"),
        (
            base("", &[("MASTER_PORT", "70000")]),
            "MASTER_PORT='70000' is not a port number",
        ),
        (
            InitOptions {
                init_method: Some("file:///tmp/rdzv".into()),
                ..base("", &[])
            },
            "init_method 'file:///tmp/rdzv' is not env://, tcp://HOST:PORT or threads://NAME",
        ),
        (
            InitOptions {
                init_method: Some("tcp://host".into()),
                ..base("", &[])
            },
            "init_method 'tcp://host' is not tcp://HOST:PORT",
        ),
        (
            InitOptions {
                backend: "smoke-signals".into(),
                ..base("", &[])
            },
            "unknown backend 'smoke-signals'",
        ),
        (
            base("", &[]).with_timeout(Duration::ZERO),
            "timeout must be positive",
        ),
    ];
    for (opts, want) in cases {
        let err = opts.resolve().unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        assert!(
            err.to_string().contains(want),
            "expected '{want}' in: {err}"
        );
        // init_process_group reports the same, before any rendezvous.
        let err = init_process_group(opts).err().unwrap();
        assert!(
            err.to_string().contains(want),
            "expected '{want}' in: {err}"
        );
    }
    // nccl is built with the `cuda` feature (tests/distributed/distributed/nccl.rs covers it).
    let unsupported: &[&str] = if cfg!(feature = "cuda") {
        &["mpi", "ucc"]
    } else {
        &["nccl", "mpi", "ucc"]
    };
    for &backend in unsupported {
        let err = init_process_group(InitOptions {
            backend: backend.into(),
            ..base("", &[])
        })
        .err()
        .unwrap();
        assert!(matches!(err, Error::Unsupported(_)), "{err:?}");
        assert!(err.to_string().contains(backend), "{err}");
    }
    assert!(!is_initialized());
}

#[test]
fn default_group_errors_without_init_and_on_double_init() {
    for (call, res) in [
        ("get_rank", get_rank().map(|_| ())),
        ("get_world_size", get_world_size().map(|_| ())),
        ("default_group", default_group().map(|_| ())),
        ("destroy_process_group", destroy_process_group()),
    ] {
        let err = res.unwrap_err();
        assert!(
            matches!(err, Error::NotInitialized { call: c } if c == call),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("call init_process_group first"),
            "{err}"
        );
    }
    init_process_group(InitOptions::threads("double-init", 1, 0)).unwrap();
    let err = init_process_group(InitOptions::threads("double-init-2", 1, 0))
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("already initialized (rank 0 of 1)"),
        "{err}"
    );
    destroy_process_group().unwrap();
    // After destroy the thread may join a world again.
    init_process_group(InitOptions::threads("double-init", 1, 0)).unwrap();
    destroy_process_group().unwrap();
}

#[test]
fn a_rendezvous_with_missing_ranks_times_out_naming_them() {
    let timeout = Duration::from_millis(400);
    let start = Instant::now();
    let out = on_threads(3, |r| {
        if r == 1 {
            return Ok(()); // never joins
        }
        init_process_group(InitOptions::threads("missing-rank", 3, r).with_timeout(timeout))
            .map(|_| ())
    });
    assert!(
        start.elapsed() < timeout + Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    for r in [0, 2] {
        match &out[r] {
            Err(Error::Timeout {
                missing_ranks,
                rank,
                op,
                ..
            }) => {
                assert_eq!((missing_ranks.as_slice(), *rank), (&[1][..], r));
                assert!(op.contains("threads://missing-rank"), "{op}");
            }
            other => panic!("rank {r}: expected a timeout, got {other:?}"),
        }
    }
    // The key is free again: a complete world forms under it.
    let out = on_threads(3, |r| {
        let g =
            init_process_group(InitOptions::threads("missing-rank", 3, r).with_timeout(timeout))?;
        g.barrier()?;
        destroy_process_group()
    });
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
}

#[test]
fn ranks_that_disagree_on_the_world_are_errors() {
    let timeout = Duration::from_millis(300);
    // Two threads claim rank 0: the second is refused, the first times out waiting for 1.
    let out = on_threads(2, |_| {
        init_process_group(InitOptions::threads("dup-rank", 2, 0).with_timeout(timeout)).map(|_| ())
    });
    let msgs: Vec<String> = out
        .iter()
        .map(|r| r.as_ref().unwrap_err().to_string())
        .collect();
    assert!(
        msgs.iter()
            .any(|m| m.contains("rank 0 already joined rendezvous 'threads://dup-rank'")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter().any(|m| m.contains("ranks [1] never arrived")),
        "{msgs:?}"
    );
    // Different world sizes under one key.
    let out = on_threads(2, |r| {
        std::thread::sleep(Duration::from_millis(50 * r as u64)); // rank 0 first
        init_process_group(InitOptions::threads("ws-mismatch", 2 + r, r).with_timeout(timeout))
            .map(|_| ())
    });
    // Whichever joined second is refused; the first times out waiting.
    let msgs: Vec<String> = out
        .iter()
        .map(|r| r.as_ref().unwrap_err().to_string())
        .collect();
    assert!(
        msgs.contains(&"invalid argument: init_process_group: rendezvous 'threads://ws-mismatch' has world size 2 (set by the first rank to join) but rank 1 gave 3".to_string())
            || msgs.iter().any(|m| m.contains("has world size 3 (set by the first rank to join) but rank 0 gave 2")),
        "{msgs:?}"
    );
    assert!(msgs.iter().any(|m| m.contains("never arrived")), "{msgs:?}");
}

#[test]
fn a_rank_that_leaves_the_world_fails_waiting_peers_promptly() {
    // destroy_process_group, and a rank thread that just ends, both count as leaving.
    for how in ["destroy", "thread ends"] {
        let name = format!("leave-{}", how.replace(' ', "-"));
        let start = Instant::now();
        let out = on_threads(3, |r| {
            let g = init_process_group(
                InitOptions::threads(&name, 3, r).with_timeout(Duration::from_secs(30)),
            )?;
            if r == 2 {
                if how == "destroy" {
                    destroy_process_group()?;
                }
                return Ok(());
            }
            g.all_reduce(
                &Tensor::zeros(&[4], fsdp::tensor::DType::F32),
                ReduceOp::Sum,
            )
        });
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{how}: {:?}",
            start.elapsed()
        );
        for r in [0, 1] {
            match &out[r] {
                Err(Error::PeerFailed {
                    failed_rank: 2,
                    reason,
                }) => {
                    assert!(
                        reason.contains("rank 2 exited without calling all_reduce"),
                        "{reason}"
                    )
                }
                other => panic!("{how}: rank {r} expected PeerFailed naming rank 2, got {other:?}"),
            }
        }
    }
}

#[test]
fn launch_sets_each_rank_threads_default_group() {
    let out = launch(&LaunchOptions::new(3), |pg| {
        let t = Tensor::from_vec(vec![1.0f32], &[1])?;
        default_group()?.all_reduce(&t, ReduceOp::Sum)?;
        let again = init_process_group(InitOptions::threads("inside-launch", 1, 0));
        assert!(again
            .err()
            .unwrap()
            .to_string()
            .contains("already initialized"));
        Ok((
            get_rank()?,
            pg.rank(),
            get_world_size()?,
            get_node_local_rank()?,
            t.to_vec_f32()?[0],
        ))
    })
    .unwrap();
    assert_eq!(
        out,
        vec![(0, 0, 3, 0, 3.0), (1, 1, 3, 1, 3.0), (2, 2, 3, 2, 3.0)]
    );
    assert!(!is_initialized(), "launch leaves the calling thread alone");
}
