//! The `tcp` backend (alias `gloo`): ranks as threads of this test, each joining through
//! `init_process_group` with its own torchrun variables on a free port, exactly as separate
//! processes would. Every collective equals the `threads` backend's bit for bit; mismatches,
//! early exits, failures and missing ranks end every rank with an error naming the culprit.

use crate::common;
use common::{free_port, on_threads, torchrun_env as env};

use fsdp::distributed::{
    abort_process_group, destroy_process_group, get_backend, init_device_mesh, init_process_group,
    launch, new_subgroups, Group, InitOptions, JobAuth, JobSecret, LaunchOptions, ReduceOp, Store,
    TcpStore,
};
use fsdp::tensor::{DType, Tensor};
use fsdp::Error;
use std::time::Duration;

fn opts(backend: &str, port: u16, world: usize, rank: usize, timeout_s: f64) -> InitOptions {
    InitOptions::new(backend)
        .with_env(env(port, world, rank))
        .with_timeout(Duration::from_secs_f64(timeout_s))
}

/// `f(world group)` on `world` tcp ranks; each rank destroys its group afterwards.
fn on_tcp<T: Send>(world: usize, f: impl Fn(Group) -> fsdp::Result<T> + Sync) -> Vec<T> {
    let port = free_port();
    on_threads(world, |r| {
        let pg = init_process_group(opts("tcp", port, world, r, 20.0))?;
        let out = f(pg)?;
        destroy_process_group()?;
        Ok(out)
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// Rank `r`'s values for input `what`: floats over many binades (so that the order of
/// summation shows in the rounding), integers for i32.
fn input(what: u64, r: usize, n: usize, dtype: DType) -> Tensor {
    let v = common::values(what * 31 + r as u64, n);
    let f: Vec<f32> = v
        .iter()
        .enumerate()
        .map(|(i, x)| x * 2f32.powi((i as i32 * 7 + r as i32 * 3) % 21 - 10))
        .collect();
    if dtype == DType::I32 {
        let ints: Vec<i32> = v.iter().map(|x| (x * 1000.0) as i32).collect();
        return Tensor::from_vec(ints, &[n]).unwrap();
    }
    Tensor::from_vec(f, &[n]).unwrap().to_dtype(dtype).unwrap()
}

/// The raw bits of every element.
fn bits(t: &Tensor) -> Vec<u32> {
    match t.dtype() {
        DType::F32 => t
            .data::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::BF16 => t
            .data::<half::bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u32)
            .collect(),
        DType::F16 => t
            .data::<half::f16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u32)
            .collect(),
        DType::I32 => t.data::<i32>().unwrap().iter().map(|&x| x as u32).collect(),
        // Not used by these tests (tests/distributed/f64.rs checks f64): the low half of the bits.
        DType::F64 => t
            .data::<f64>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u32)
            .collect(),
        DType::I64 => t.data::<i64>().unwrap().iter().map(|&x| x as u32).collect(),
    }
}

const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::I32];
const SIZES: [usize; 4] = [0, 1, 5, 33];
const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

/// Every collective of the trait, out of place and in place, every dtype and size: what
/// this rank ends up with, as bits.
fn every_collective(pg: &Group) -> fsdp::Result<Vec<(String, Vec<u32>)>> {
    let (r, w) = (pg.rank(), pg.size());
    let mut out = Vec::new();
    for dtype in DTYPES {
        for n in SIZES {
            let tag = |what: &str| format!("{what} {dtype} n={n}");
            let g = Tensor::zeros(&[n * w], dtype);
            pg.all_gather_into_tensor(&g, &input(1, r, n, dtype))?;
            out.push((tag("all_gather"), bits(&g)));
            let g = Tensor::zeros(&[n * w], dtype);
            g.view(r * n, &[n])?.copy_from(&input(1, r, n, dtype))?;
            pg.all_gather_into_tensor(&g, &g.view(r * n, &[n])?)?;
            out.push((tag("all_gather in place"), bits(&g)));
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let shard = Tensor::zeros(&[n], dtype);
                pg.reduce_scatter_tensor(&shard, &input(2, r, n * w, dtype), op)?;
                out.push((tag(&format!("reduce_scatter {op:?}")), bits(&shard)));
                let big = input(2, r, n * w, dtype);
                pg.reduce_scatter_tensor(&big.view(r * n, &[n])?, &big, op)?;
                out.push((tag(&format!("reduce_scatter in place {op:?}")), bits(&big)));
            }
            for op in OPS {
                let t = input(3, r, n, dtype);
                pg.all_reduce(&t, op)?;
                out.push((tag(&format!("all_reduce {op:?}")), bits(&t)));
            }
            for src in 0..w {
                let t = input(4, r, n, dtype);
                pg.broadcast(&t, src)?;
                out.push((tag(&format!("broadcast from {src}")), bits(&t)));
            }
            pg.barrier()?;
        }
    }
    Ok(out)
}

#[test]
fn every_collective_equals_the_threads_backend_bit_for_bit() {
    for world in 1..=4 {
        let want = launch(&LaunchOptions::new(world), |pg| every_collective(&pg)).unwrap();
        let got = on_tcp(world, |pg| {
            assert_eq!(pg.backend(), "tcp");
            every_collective(&pg)
        });
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len());
            for ((what, a), (_, b)) in g.iter().zip(w) {
                assert_eq!(a, b, "world {world} rank {r}: {what}");
            }
        }
    }
}

#[test]
fn a_mismatch_fails_every_rank_worded_as_the_threads_backend_and_the_group_goes_on() {
    let call = |pg: &Group| {
        let r = pg.rank();
        let t = Tensor::zeros(&[5 + r], DType::F32);
        let first = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
        let second = if r == 1 {
            pg.broadcast(&Tensor::zeros(&[4], DType::BF16), 0)
        } else {
            pg.all_reduce(&Tensor::zeros(&[4], DType::BF16), ReduceOp::Max)
        }
        .unwrap_err();
        // The group is still usable: a matching call succeeds.
        let t = Tensor::from_vec(vec![r as f32 + 1.0], &[1])?;
        pg.all_reduce(&t, ReduceOp::Sum)?;
        assert_eq!(t.data::<f32>()?[0], 6.0);
        Ok((first.to_string(), second.to_string()))
    };
    let want = launch(&LaunchOptions::new(3), |pg| call(&pg)).unwrap();
    let got = on_tcp(3, |pg| call(&pg));
    assert_eq!(got, want);
    assert!(
        got[0].0.contains("collective mismatch in group of 3 ranks"),
        "{}",
        got[0].0
    );
    assert!(got[2].1.contains("rank 1 called broadcast"), "{}", got[2].1);
}

#[test]
fn a_rank_that_returns_early_is_named_by_the_others() {
    let port = free_port();
    let res = on_threads(3, |r| {
        // A long timeout: leaving is noticed at once, not by waiting it out.
        init_process_group(opts("tcp", port, 3, r, 20.0))?;
        if r == 2 {
            // Returns without destroy_process_group: leaving the thread leaves the world.
            return Ok(());
        }
        let t = Tensor::zeros(&[8], DType::F32);
        fsdp::distributed::default_group()?.all_reduce(&t, ReduceOp::Sum)
    });
    assert!(res[2].is_ok());
    for e in [&res[0], &res[1]] {
        match e {
            Err(Error::PeerFailed {
                failed_rank: 2,
                reason,
            }) => {
                assert!(reason.contains("rank 2"), "{reason}")
            }
            Err(Error::Timeout { missing_ranks, .. }) => assert!(missing_ranks.contains(&2)),
            other => panic!("expected rank 2 named, got {other:?}"),
        }
    }
}

#[test]
fn a_failing_rank_reason_reaches_every_peer() {
    let port = free_port();
    let res = on_threads(3, |r| {
        let pg = init_process_group(opts("tcp", port, 3, r, 20.0))?;
        if r == 1 {
            abort_process_group("rank 1 ran out of data");
            return Ok(());
        }
        let t = Tensor::zeros(&[3], DType::F32);
        let e = pg.all_reduce(&t, ReduceOp::Sum);
        // Later calls fail the same way at once.
        let again = pg.barrier();
        assert!(
            matches!(again, Err(Error::PeerFailed { failed_rank: 1, .. })),
            "{again:?}"
        );
        e
    });
    for r in [0, 2] {
        match &res[r] {
            Err(Error::PeerFailed {
                failed_rank: 1,
                reason,
            }) => assert!(reason.contains("ran out of data"), "{reason}"),
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn a_rank_that_never_joins_is_named_in_the_timeout() {
    let port = free_port();
    // World of 3, rank 2 never starts.
    let res = on_threads(2, |r| {
        init_process_group(opts("tcp", port, 3, r, 1.0)).map(drop)
    });
    for (r, e) in res.iter().enumerate() {
        match e {
            Err(Error::Timeout { missing_ranks, .. }) => {
                assert_eq!(missing_ranks, &vec![2], "rank {r}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    // Rank 0 never starts: no store answers, and rank 0 is named.
    let port = free_port();
    let e = init_process_group(opts("gloo", port, 2, 1, 0.5))
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::Timeout { missing_ranks, .. } if missing_ranks == &vec![0]),
        "{e:?}"
    );
}

#[test]
fn subgroups_and_meshes_run_over_tcp() {
    let out = on_tcp(4, |pg| {
        let r = pg.rank();
        let (sub, all) = new_subgroups(pg.as_ref(), 2)?;
        assert_eq!(all, vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(sub.backend(), "tcp");
        let t = Tensor::from_vec(vec![r as f32], &[1])?;
        sub.all_reduce(&t, ReduceOp::Sum)?;
        let mesh = init_device_mesh(pg.as_ref(), &[2, 2], &["replicate", "shard"])?;
        let col = mesh.get_group("replicate")?;
        let c = Tensor::from_vec(vec![10.0 * r as f32], &[1])?;
        col.all_reduce(&c, ReduceOp::Sum)?;
        // Not a member: no group, no communication.
        let none = pg.new_group(&[0, 1])?;
        assert_eq!(none.is_some(), r < 2);
        // The world group still works beside the subgroups.
        pg.barrier()?;
        let (t, c) = (t.data::<f32>()?[0], c.data::<f32>()?[0]);
        Ok((t, c, col.ranks()))
    });
    assert_eq!(out[0], (1.0, 20.0, vec![0, 2]));
    assert_eq!(out[1], (1.0, 40.0, vec![1, 3]));
    assert_eq!(out[2], (5.0, 20.0, vec![0, 2]));
    assert_eq!(out[3], (5.0, 40.0, vec![1, 3]));
}

#[test]
fn gloo_is_an_alias_and_bad_worlds_are_clear_errors() {
    let port = free_port();
    let res = on_threads(2, |r| {
        init_process_group(opts("GLOO", port, 2, r, 20.0))?;
        let b = get_backend()?;
        destroy_process_group()?;
        Ok(b)
    });
    assert!(res.iter().all(|b| matches!(b, Ok("tcp"))), "{res:?}");
    let e = InitOptions {
        init_method: Some("threads://x".into()),
        ..opts("tcp", port, 2, 0, 1.0)
    }
    .resolve()
    .unwrap_err();
    assert!(e.to_string().contains("backend tcp meets at env://"), "{e}");
    // Ranks that disagree on the world size.
    let port = free_port();
    let res = on_threads(2, |r| {
        init_process_group(opts("tcp", port, 2 + r, r, 1.0)).map(drop)
    });
    let e = res[1].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("has world size 2 (set by rank 0) but rank 1 gave 3"),
        "{e}"
    );
    // Two ranks 1 in a world of 2: one of them is refused, naming the rank.
    let port = free_port();
    let ones_done = std::sync::atomic::AtomicUsize::new(0);
    let res = on_threads(3, |i| {
        let r = i.min(1);
        let res = init_process_group(opts("tcp", port, 2, r, 20.0)).map(drop);
        if r == 0 {
            // Rank 0 hosts the store: it stays until both ranks 1 have their answer.
            while ones_done.load(std::sync::atomic::Ordering::SeqCst) < 2 {
                std::thread::sleep(Duration::from_millis(1));
            }
        } else {
            ones_done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        res
    });
    let refused: Vec<String> = res
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .filter(|e| e.contains("joined twice"))
        .collect();
    assert_eq!(refused.len(), 1, "{res:?}");
    assert!(refused[0].contains("rank 1"), "{}", refused[0]);
}

#[test]
fn a_rank_that_never_calls_a_collective_is_named_in_the_timeout() {
    let port = free_port();
    let gave_up = std::sync::atomic::AtomicUsize::new(0);
    let res = on_threads(3, |r| {
        let pg = init_process_group(opts("tcp", port, 3, r, 2.0))?;
        if r == 2 {
            // Alive and connected, but busy elsewhere until the others gave up.
            while gave_up.load(std::sync::atomic::Ordering::SeqCst) < 2 {
                std::thread::sleep(Duration::from_millis(5));
            }
            return Ok(());
        }
        let t = Tensor::zeros(&[4], DType::F32);
        let e = pg.all_reduce(&t, ReduceOp::Sum);
        gave_up.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // The group is broken now: the next call fails at once, naming the same rank.
        let again = pg.barrier();
        assert!(
            matches!(again, Err(Error::PeerFailed { failed_rank: 2, .. })),
            "{again:?}"
        );
        e
    });
    for r in [0, 1] {
        match &res[r] {
            Err(e @ Error::Timeout { missing_ranks, .. }) => {
                assert_eq!(missing_ranks, &vec![2], "rank {r}: {e}");
                assert!(e.to_string().contains("all_reduce timed out"), "{e}");
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn a_rank_of_another_job_is_refused_naming_both_job_ids() {
    let port = free_port();
    let res = on_threads(2, |r| {
        let job = if r == 0 { "job-a" } else { "job-b" };
        init_process_group(opts("tcp", port, 2, r, 3.0).with_job(job, None)).map(drop)
    });
    match &res[1] {
        Err(e @ Error::Refused { .. }) => assert!(
            e.to_string().contains(&format!(
                "TCPStore at 127.0.0.1:{port} (rank 1): it belongs to job 'job-a', not to this rank's job 'job-b': another job holds this address"
            )),
            "{e}"
        ),
        other => panic!("rank 1: {other:?}"),
    }
    // Rank 0's world never saw it.
    match &res[0] {
        Err(Error::Timeout { missing_ranks, .. }) => assert_eq!(missing_ranks, &vec![1]),
        other => panic!("rank 0: {other:?}"),
    }
    // Job ids from the environment, torchrun's name too: equal ids meet.
    let port = free_port();
    let sums = on_threads(2, |r| {
        let mut env = env(port, 2, r);
        env.push(("TORCHELASTIC_RUN_ID", "run-7".into()));
        let pg = init_process_group(
            InitOptions::new("tcp")
                .with_env(env)
                .with_timeout(Duration::from_secs(20)),
        )?;
        let t = Tensor::from_vec(vec![r as f32 + 1.0], &[1])?;
        pg.all_reduce(&t, ReduceOp::Sum)?;
        destroy_process_group()?;
        t.to_vec_f32()
    });
    for s in sums {
        assert_eq!(s.unwrap(), vec![3.0]);
    }
}

#[test]
fn a_mesh_peer_that_cannot_prove_the_job_secret_is_refused() {
    let port = free_port();
    let secret = JobSecret::new("the secret of job-m, 32 chars...").unwrap();
    let job = |r: usize| opts("tcp", port, 2, r, 20.0).with_job("job-m", Some(secret.clone()));
    let sum = |pg: Group, r: usize| -> fsdp::Result<Vec<f32>> {
        let t = Tensor::from_vec(vec![r as f32 + 1.0, 10.0], &[2])?;
        pg.all_reduce(&t, ReduceOp::Sum)?;
        destroy_process_group()?;
        t.to_vec_f32()
    };
    std::thread::scope(|scope| {
        let rank0 = scope.spawn(|| sum(init_process_group(job(0))?, 0));
        // An outsider that learned rank 0's mesh address (here through the store) dials it
        // as rank 1, without the secret, before rank 1 does.
        let auth = JobAuth::new("job-m", Some(secret.clone())).unwrap();
        let store =
            TcpStore::connect_with_auth("127.0.0.1", port, 9, Duration::from_secs(20), auth)
                .unwrap();
        let addr = String::from_utf8(store.get("pg/world/addr/0").unwrap()).unwrap();
        // Rank 0 accepts once every rank published its address, in the order they
        // connected: both outsiders first.
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        // One that skips the job handshake and speaks the mesh's own is dropped.
        let mut raw = std::net::TcpStream::connect(&addr).unwrap();
        use std::io::Write;
        let _ = raw.write_all(b"fsdp-tcp-pg/1 and then some bytes");
        let rank1 = scope.spawn(|| sum(init_process_group(job(1))?, 1));
        let (accepted, why) =
            common::raw_handshake(&mut s, "mesh rank 1", "job-m", &[1u8; 32]).unwrap();
        assert!(!accepted);
        assert_eq!(why, "its proof of the job secret is wrong (another secret)");
        // The real rank 1 still joins, and the world computes as usual.
        assert_eq!(rank0.join().unwrap().unwrap(), vec![3.0, 20.0]);
        assert_eq!(rank1.join().unwrap().unwrap(), vec![3.0, 20.0]);
    });
}
