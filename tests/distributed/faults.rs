//! Faults across ranks: every case ends on every rank within a short group timeout, with an
//! error that names the rank(s) at fault, and leaves the process able to run new worlds.

use crate::common;

use fsdp::distributed::{launch, Group, LaunchOptions, ReduceOp};
use fsdp::fsdp::{size_based_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel};
use fsdp::nn::{loss, Context, Module};
use fsdp::optim::{Optimizer, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};
use fsdp::Error;
use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// The group timeout of these tests: what a rank that never arrives costs.
const TIMEOUT: Duration = Duration::from_secs(2);

/// How one rank ended.
#[derive(Debug, Clone, PartialEq)]
enum Ended {
    Ok,
    /// A returned error: its variant, its text and the ranks it blames.
    Err {
        kind: &'static str,
        text: String,
        named: Vec<usize>,
    },
    Panicked,
}

/// The ranks an error blames: the failed rank, the ranks that never arrived, or the ranks
/// whose call differed from rank 0's.
fn blamed(e: &Error) -> (&'static str, Vec<usize>) {
    match e {
        Error::PeerFailed { failed_rank, .. } => ("PeerFailed", vec![*failed_rank]),
        Error::Timeout { missing_ranks, .. } => ("Timeout", missing_ranks.clone()),
        Error::CollectiveMismatch { detail, .. } => {
            let differing = detail.split(" but ").nth(1).unwrap_or("");
            let ranks = differing
                .split("rank ")
                .skip(1)
                .filter_map(|s| s.split(' ').next()?.parse().ok())
                .collect();
            ("CollectiveMismatch", ranks)
        }
        _ => ("other", vec![]),
    }
}

/// Runs `f` on `world` ranks with the short timeout. Returns how every rank ended (launch
/// itself reports only the root cause), launch's error, and the wall time.
fn run<F>(world: usize, timeout: Duration, f: F) -> (Vec<Ended>, Option<Error>, Duration)
where
    F: Fn(&Group) -> fsdp::Result<()> + Sync,
{
    let ended = Mutex::new(vec![Ended::Panicked; world]);
    let mut opts = LaunchOptions::new(world);
    opts.timeout = timeout;
    let start = Instant::now();
    let res = launch(&opts, |pg| {
        let res = f(&pg);
        ended.lock()[pg.rank()] = match &res {
            Ok(()) => Ended::Ok,
            Err(e) => {
                let (kind, named) = blamed(e);
                Ended::Err {
                    kind,
                    text: e.to_string(),
                    named,
                }
            }
        };
        res
    });
    (ended.into_inner(), res.err(), start.elapsed())
}

/// Asserts every listed rank ended with a `kind` error blaming exactly `named`, whose text
/// contains `text`.
fn assert_blamed(ended: &[Ended], ranks: &[usize], kind: &str, named: &[usize], text: &str) {
    for &r in ranks {
        match &ended[r] {
            Ended::Err {
                kind: k,
                text: t,
                named: n,
            } => {
                assert_eq!((*k, n.as_slice()), (kind, named), "rank {r}: {t}");
                assert!(t.contains(text), "rank {r}: expected '{text}' in: {t}");
            }
            other => panic!("rank {r}: expected a {kind} error, got {other:?}"),
        }
    }
}

/// Asserts the case ended promptly: well before the group timeout.
fn assert_prompt(elapsed: Duration) {
    assert!(
        elapsed < TIMEOUT,
        "took {elapsed:?}, the group timeout is {TIMEOUT:?}"
    );
}

/// A fresh world in the same process works: nothing of the failed one leaks into it.
fn a_new_world_still_works() {
    let out = launch(&LaunchOptions::new(3), |pg| {
        let t = Tensor::from_vec(vec![pg.rank() as f32 + 1.0], &[1])?;
        pg.all_reduce(&t, ReduceOp::Sum)?;
        pg.barrier()?;
        Ok(t.to_vec_f32()?[0])
    })
    .unwrap();
    assert_eq!(out, vec![6.0; 3]);
}

#[test]
fn mismatched_sizes_and_dtypes_fail_every_rank_naming_the_odd_one() {
    let (ended, err, elapsed) = run(4, TIMEOUT, |pg| {
        let n = if pg.rank() == 2 { 5 } else { 4 };
        pg.all_reduce(&Tensor::zeros(&[n], DType::F32), ReduceOp::Sum)
    });
    assert_prompt(elapsed);
    let want = "rank 0 called all_reduce(f32, 4 -> 4 elements, Sum) but rank 2 called all_reduce(f32, 5 -> 5 elements, Sum)";
    assert_blamed(&ended, &[0, 1, 2, 3], "CollectiveMismatch", &[2], want);
    assert!(err.unwrap().to_string().contains(want));

    let (ended, _, elapsed) = run(3, TIMEOUT, |pg| {
        let dtype = if pg.rank() == 1 {
            DType::BF16
        } else {
            DType::F32
        };
        let out = Tensor::zeros(&[6], dtype);
        pg.all_gather_into_tensor(&out, &Tensor::zeros(&[2], dtype))
    });
    assert_prompt(elapsed);
    let want = "rank 1 called all_gather_into_tensor(bf16, 2 -> 6 elements)";
    assert_blamed(&ended, &[0, 1, 2], "CollectiveMismatch", &[1], want);
    a_new_world_still_works();
}

#[test]
fn mismatched_ops_fail_every_rank_naming_the_odd_one() {
    type Call = fn(&Group, &Tensor) -> fsdp::Result<()>;
    let cases: [(Call, Call, &str); 3] = [
        (
            |pg, t| pg.all_reduce(t, ReduceOp::Sum),
            |pg, t| pg.broadcast(t, 0),
            "rank 2 called broadcast(f32, 4 -> 4 elements, src=0)",
        ),
        (
            |pg, t| pg.all_reduce(t, ReduceOp::Sum),
            |pg, t| pg.all_reduce(t, ReduceOp::Max),
            "rank 2 called all_reduce(f32, 4 -> 4 elements, Max)",
        ),
        (
            |pg, t| pg.broadcast(t, 0),
            |pg, t| pg.broadcast(t, 1),
            "rank 2 called broadcast(f32, 4 -> 4 elements, src=1)",
        ),
    ];
    for (most, odd, want) in cases {
        let (ended, _, elapsed) = run(3, TIMEOUT, |pg| {
            let t = Tensor::zeros(&[4], DType::F32);
            if pg.rank() == 2 {
                odd(pg, &t)
            } else {
                most(pg, &t)
            }
        });
        assert_prompt(elapsed);
        assert_blamed(&ended, &[0, 1, 2], "CollectiveMismatch", &[2], want);
    }
    a_new_world_still_works();
}

#[test]
fn a_rank_that_skips_a_collective_is_named() {
    // It goes on to the next collective: that one meets the others' barrier.
    let (ended, _, elapsed) = run(3, TIMEOUT, |pg| {
        if pg.rank() != 1 {
            pg.barrier()?;
        }
        pg.all_reduce(&Tensor::zeros(&[2], DType::F32), ReduceOp::Sum)
    });
    assert_prompt(elapsed);
    assert_blamed(
        &ended,
        &[0, 1, 2],
        "CollectiveMismatch",
        &[1],
        "rank 0 called barrier(f32, 0 -> 0 elements) but rank 1 called all_reduce",
    );

    // It returns: the others fail at once rather than wait out the timeout.
    let (ended, err, elapsed) = run(3, TIMEOUT, |pg| {
        if pg.rank() == 1 {
            return Ok(());
        }
        pg.barrier()
    });
    assert_prompt(elapsed);
    assert_eq!(ended[1], Ended::Ok);
    assert_blamed(
        &ended,
        &[0, 2],
        "PeerFailed",
        &[1],
        // Which other ranks had reached the barrier when the first one noticed varies.
        "rank 1 exited without calling barrier (ranks [",
    );
    assert!(err.unwrap().to_string().contains("rank 1 exited"));

    // It stays busy past the timeout: the others time out naming it.
    let short = Duration::from_millis(1000);
    let (ended, _, elapsed) = run(3, short, |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(short * 2);
            return Ok(());
        }
        pg.barrier()
    });
    assert!(elapsed < short * 2 + TIMEOUT, "took {elapsed:?}");
    for r in [0, 2] {
        match &ended[r] {
            // The first to give up times out; the other may see that failure recorded. On a
            // loaded machine the other waiting rank may not have reached the barrier yet
            // either, so it can be named beside rank 1 (never the rank reporting).
            Ended::Err { kind, named, text } => {
                assert!(
                    (*kind == "Timeout" || *kind == "PeerFailed")
                        && named.contains(&1)
                        && (*kind == "PeerFailed" || !named.contains(&r)),
                    "rank {r}: {text}"
                );
                assert!(
                    text.contains("barrier timed out after 1.0 s"),
                    "rank {r}: {text}"
                );
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    a_new_world_still_works();
}

/// Steps of the uneven model under FSDP (one unit per Linear); `fault(step)` runs on every
/// rank between forward and backward.
fn train(pg: &Group, steps: usize, fault: &dyn Fn(usize) -> fsdp::Result<()>) -> fsdp::Result<()> {
    let cfg = FsdpConfig {
        auto_wrap_policy: Some(size_based_auto_wrap_policy(1)),
        ..Default::default()
    };
    let mut m = FullyShardedDataParallel::new(common::uneven_model(3), pg.clone(), cfg)?;
    let mut opt = SGD::new(SgdConfig {
        lr: 0.05,
        ..Default::default()
    });
    for step in 1..=steps {
        let x = Tensor::from_vec(
            common::values(step as u64 * 10 + pg.rank() as u64, 14),
            &[2, 7],
        )?;
        let y = m.forward(&x, &Context::train())?;
        let (_, dy) = loss::sum_loss(&y)?;
        fault(step)?;
        m.backward(&dy, &Context::train())?;
        opt.step(&m.optimizer_params())?;
        m.zero_grad();
    }
    Ok(())
}

#[test]
fn a_rank_that_panics_or_fails_mid_training_is_named_by_every_peer() {
    // Healthy first: the loop itself runs to the end.
    let (ended, _, _) = run(3, TIMEOUT, |pg| train(pg, 4, &|_| Ok(())));
    assert_eq!(ended, vec![Ended::Ok; 3]);

    let (ended, err, elapsed) = run(3, TIMEOUT, |pg| {
        let me = pg.rank();
        train(pg, 4, &|step| {
            if me == 1 && step == 3 {
                panic!("injected panic at step {step}");
            }
            Ok(())
        })
    });
    assert_prompt(elapsed);
    assert_eq!(ended[1], Ended::Panicked);
    assert_blamed(
        &ended,
        &[0, 2],
        "PeerFailed",
        &[1],
        "panicked: injected panic at step 3",
    );
    assert_eq!(
        err.unwrap().to_string(),
        "rank 1 failed: panicked: injected panic at step 3"
    );

    let (ended, err, elapsed) = run(3, TIMEOUT, |pg| {
        let me = pg.rank();
        train(pg, 4, &|step| match (me, step) {
            (2, 2) => Err(Error::Data("injected error".into())),
            _ => Ok(()),
        })
    });
    assert_prompt(elapsed);
    assert_blamed(&ended, &[0, 1], "PeerFailed", &[2], "data: injected error");
    assert_eq!(
        err.unwrap().to_string(),
        "rank 2 failed: data: injected error"
    );
    a_new_world_still_works();
}

// A rank that applies an FSDP unit more often than the others, skips a micro-batch or
// steps at another point: tests/fsdp/divergence.rs (the collectives' fingerprints).
