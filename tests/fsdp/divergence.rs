//! Ranks that take different code paths under FSDP (data-dependent control flow, a skipped
//! micro-batch, steps taken at different points): every collective carries a fingerprint
//! (unit, phase, step, micro-batch, call), so the first collective where the ranks differ
//! fails on every rank within seconds, naming the unit and what each rank called, on the
//! `threads` and `tcp` backends, instead of waiting out the group timeout or pairing the
//! wrong collectives into a silently wrong result.

use crate::common;

use fsdp::distributed::{init_process_group, launch, Group, InitOptions, LaunchOptions};
use fsdp::fsdp::{
    size_based_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel, ShardingStrategy,
};
use fsdp::nn::{loss, ChildVisitor, Context, InitKey, Linear, Module};
use fsdp::optim::{Optimizer, SgdConfig, SGD};
use fsdp::tensor::Tensor;
use std::time::{Duration, Instant};

/// A group timeout far above the bound the tests assert: only the fingerprints can make a
/// case end in time.
const TIMEOUT: Duration = Duration::from_secs(60);
/// What the issue asks: every case ends on every rank within this.
const PROMPT: Duration = Duration::from_secs(10);

/// `trunk`, then `head` applied `head_calls` times; backward goes through the head once.
struct RepeatedHead {
    trunk: Box<dyn Module>,
    head: Box<dyn Module>,
    head_calls: usize,
}

impl Module for RepeatedHead {
    fn type_name(&self) -> &str {
        "RepeatedHead"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> fsdp::Result<Tensor> {
        let mut h = self.trunk.forward(x, cx)?;
        for _ in 0..self.head_calls {
            h = self.head.forward(&h, cx)?;
        }
        Ok(h)
    }
    fn backward(&mut self, g: &Tensor, cx: &Context) -> fsdp::Result<Tensor> {
        let g = self.head.backward(g, cx)?;
        self.trunk.backward(&g, cx)
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> fsdp::Result<()> {
        f("trunk", &mut self.trunk)?;
        f("head", &mut self.head)
    }
    fn for_each_param(&mut self, f: &mut fsdp::nn::ParamVisitor<'_>) -> fsdp::Result<()> {
        fsdp::nn::no_params(f)
    }
}

/// What one rank does differently from the plain loop.
#[derive(Clone, Copy, Default)]
struct Quirks {
    /// The first micro-batch of each step runs under `no_sync`.
    no_sync_first: bool,
    /// `clip_grad_norm_` before each optimizer step.
    clip: bool,
    /// An extra `optimizer_params()` after every backward (to log, say).
    peek_params: bool,
}

/// Trains trunk + head (each its own unit) for `schedule.len()` steps of `schedule[s]`
/// micro-batches, the head applied `head_calls` times per forward; returns the parameters.
fn train(
    pg: &Group,
    strategy: ShardingStrategy,
    head_calls: usize,
    schedule: &[usize],
) -> fsdp::Result<Vec<(String, Vec<f32>)>> {
    train_with(pg, strategy, head_calls, schedule, Quirks::default())
}

fn train_with(
    pg: &Group,
    strategy: ShardingStrategy,
    head_calls: usize,
    schedule: &[usize],
    quirks: Quirks,
) -> fsdp::Result<Vec<(String, Vec<f32>)>> {
    let k = InitKey::new(5);
    let model = RepeatedHead {
        trunk: Box::new(Linear::new(7, 7, false, &k.child("trunk"))?),
        head: Box::new(Linear::new(7, 7, false, &k.child("head"))?),
        head_calls,
    };
    let cfg = FsdpConfig {
        sharding_strategy: strategy,
        ranks_per_node: strategy
            .is_hybrid()
            .then(|| common::hybrid_ranks_per_node(pg.size())),
        auto_wrap_policy: Some(size_based_auto_wrap_policy(1)),
        ..Default::default()
    };
    let mut m = FullyShardedDataParallel::new(Box::new(model), pg.clone(), cfg)?;
    let mut opt = SGD::new(SgdConfig {
        lr: 0.1,
        ..Default::default()
    });
    let mut batch = 0u64;
    for &micro_batches in schedule {
        for mb in 0..micro_batches {
            let x = Tensor::from_vec(common::values(batch * 8 + pg.rank() as u64, 14), &[2, 7])?;
            batch += 1;
            let step = |m: &mut FullyShardedDataParallel| -> fsdp::Result<()> {
                let y = m.forward(&x, &Context::train())?;
                let (_, dy) = loss::sum_loss(&y)?;
                m.backward(&dy, &Context::train()).map(drop)
            };
            if quirks.no_sync_first && mb == 0 {
                m.no_sync(|m| step(m))?;
            } else {
                step(&mut m)?;
            }
            if quirks.peek_params {
                assert!(!m.optimizer_params().is_empty());
            }
        }
        if quirks.clip {
            m.clip_grad_norm_(0.5, 2.0)?;
        }
        opt.step(&m.optimizer_params())?;
        m.zero_grad();
    }
    m.full_parameters()
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    Threads,
    Tcp,
}

/// Runs `f(rank, group)` on `world` ranks of `backend` with the long timeout; every rank's
/// result and the wall time.
fn run<T: Send>(
    backend: Backend,
    world: usize,
    f: impl Fn(usize, &Group) -> fsdp::Result<T> + Sync,
) -> (Vec<fsdp::Result<T>>, Duration) {
    let start = Instant::now();
    let out = match backend {
        Backend::Threads => {
            let results = parking_lot::Mutex::new((0..world).map(|_| None).collect::<Vec<_>>());
            let mut opts = LaunchOptions::new(world);
            opts.timeout = TIMEOUT;
            let _ = launch(&opts, |pg| {
                let r = f(pg.rank(), &pg);
                let ret = r.as_ref().map(drop).map_err(|e| e.duplicate());
                results.lock()[pg.rank()] = Some(r);
                ret
            });
            results
                .into_inner()
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(fsdp::Error::Fsdp("rank never ran".into()))))
                .collect()
        }
        Backend::Tcp => {
            let port = common::free_port();
            common::on_threads(world, |r| {
                let env = common::torchrun_env(port, world, r);
                let pg = init_process_group(
                    InitOptions::new("tcp").with_env(env).with_timeout(TIMEOUT),
                )?;
                let out = f(r, &pg);
                // What a rank process does (src/train/process.rs): a failing rank aborts,
                // so its peers learn why; a finished one leaves.
                match &out {
                    Err(e) => fsdp::distributed::abort_process_group(&e.to_string()),
                    Ok(_) => drop(fsdp::distributed::destroy_process_group()),
                }
                out
            })
        }
    };
    (out, start.elapsed())
}

/// Asserts every rank failed within [`PROMPT`] and that every rank's error names each of
/// `words`.
fn assert_named<T: std::fmt::Debug>(
    what: &str,
    out: &[fsdp::Result<T>],
    elapsed: Duration,
    words: &[&str],
) {
    assert!(elapsed < PROMPT, "{what}: took {elapsed:?}");
    for (r, res) in out.iter().enumerate() {
        let text = match res {
            Err(e) => e.to_string(),
            Ok(v) => panic!("{what}: rank {r} finished without an error: {v:?}"),
        };
        for w in words {
            assert!(
                text.contains(w),
                "{what}: rank {r}: expected '{w}' in: {text}"
            );
        }
    }
}

#[test]
fn a_unit_applied_more_often_on_one_rank_is_named_at_once() {
    // The last rank applies the head three times, the others once. Under FullShard its
    // second gather of the head meets the others' backward gather; under ShardGradOp and
    // NoShard the head stays gathered, and the gradient reductions disagree on how many
    // forward calls they cover.
    // Hybrid strategies shard within nodes of `hybrid_ranks_per_node` ranks (1 at world 2:
    // only the replicas' gradient all-reduce crosses ranks), so either can come first.
    let (gather, reduce) = ("forward of unit 'head'", "after 3 forward calls");
    let cases = [
        (ShardingStrategy::FullShard, vec![gather]),
        (ShardingStrategy::HybridShard, vec![gather, reduce]),
        (ShardingStrategy::ShardGradOp, vec![reduce]),
        (ShardingStrategy::HybridShardZero2, vec![reduce]),
        (ShardingStrategy::NoShard, vec![reduce]),
    ];
    for backend in [Backend::Threads, Backend::Tcp] {
        for world in [2, 4] {
            for (strategy, says) in &cases {
                let (out, elapsed) = run(backend, world, |r, pg| {
                    let calls = if r == world - 1 { 3 } else { 1 };
                    train(pg, *strategy, calls, &[1])
                });
                let what = format!("{backend:?} world {world} {strategy:?}");
                assert_named(&what, &out, elapsed, &["unit 'head'"]);
                for (r, res) in out.iter().enumerate() {
                    let text = res
                        .as_ref()
                        .err()
                        .map(|e| e.to_string())
                        .unwrap_or_default();
                    assert!(
                        says.iter().any(|s| text.contains(s)),
                        "{what}: rank {r}: expected one of {says:?} in: {text}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_skipped_micro_batch_is_named_at_the_next_step() {
    // Rank 1 runs one micro-batch where the others run two, then both step: rank 1's next
    // forward is step 1's first micro-batch while the others are in step 0's second.
    for backend in [Backend::Threads, Backend::Tcp] {
        for world in [2, 4] {
            let (out, elapsed) = run(backend, world, |r, pg| {
                let schedule: &[usize] = if r == 1 { &[1, 2] } else { &[2, 2] };
                train(pg, ShardingStrategy::FullShard, 1, schedule)
            });
            let what = format!("{backend:?} world {world}");
            assert_named(
                &what,
                &out,
                elapsed,
                &[
                    "step 0, micro-batch 1",
                    "step 1, micro-batch 0",
                    "forward of unit root",
                ],
            );
        }
    }
}

#[test]
fn micro_batch_counts_that_even_out_over_two_steps_are_not_a_silent_wrong_result() {
    // [2, 2] against [1, 3]: the same number of collectives in all, which used to pair up
    // across the step boundary and train to wrong parameters without an error.
    for backend in [Backend::Threads, Backend::Tcp] {
        for (world, strategy) in [
            (2, ShardingStrategy::FullShard),
            (2, ShardingStrategy::NoShard),
            (4, ShardingStrategy::ShardGradOp),
            (4, ShardingStrategy::HybridShard),
        ] {
            let (out, elapsed) = run(backend, world, |r, pg| {
                let schedule: &[usize] = if r == 1 { &[1, 3] } else { &[2, 2] };
                train(pg, strategy, 1, schedule)
            });
            let what = format!("{backend:?} world {world} {strategy:?}");
            assert_named(
                &what,
                &out,
                elapsed,
                &["step 0, micro-batch 1", "step 1, micro-batch 0"],
            );
        }
    }
}

#[test]
fn ranks_on_the_same_path_train_as_before() {
    // The fingerprints change nothing when every rank runs the same program: two steps of
    // two micro-batches give the same parameters on every rank and on both backends.
    let mut all = Vec::new();
    for backend in [Backend::Threads, Backend::Tcp] {
        let (out, _) = run(backend, 3, |_, pg| {
            train(pg, ShardingStrategy::FullShard, 2, &[2, 2])
        });
        let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
        for got in &out {
            assert_eq!(got, &out[0], "{backend:?}");
        }
        all.push(out[0].clone());
    }
    assert_eq!(all[0], all[1]);
}

#[test]
fn no_sync_on_one_rank_only_is_named_at_the_end_of_its_backward() {
    // Rank 1 keeps its gradients (no_sync) where the others reduce them: it goes on to the
    // next forward's gathers while they wait for it in the reductions, on another
    // communicator. The ranks compare how many reductions each backward issued before
    // waiting for them.
    let cases = [
        (2, ShardingStrategy::FullShard),
        (2, ShardingStrategy::ShardGradOp),
        (4, ShardingStrategy::HybridShard),
        (2, ShardingStrategy::NoShard),
    ];
    for backend in [Backend::Threads, Backend::Tcp] {
        for (world, strategy) in cases {
            let (out, elapsed) = run(backend, world, |r, pg| {
                let quirks = Quirks {
                    no_sync_first: r == 1,
                    ..Quirks::default()
                };
                train_with(pg, strategy, 1, &[2, 2], quirks)
            });
            let what = format!("{backend:?} world {world} {strategy:?}");
            assert_named(&what, &out, elapsed, &["step 0, micro-batch 0"]);
            for (r, res) in out.iter().enumerate() {
                let text = res
                    .as_ref()
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                assert!(
                    text.contains("end of backward of unit root after 0 gradient reductions")
                        || text.contains("gradient reduction of unit"),
                    "{what}: rank {r}: {text}"
                );
            }
        }
    }
}

#[test]
fn clipping_on_one_rank_only_fails_under_every_strategy() {
    // Under NoShard (and hybrid sharding with one rank per node) the norm needs no
    // reduction, but every rank still takes part in one, as in PyTorch: a rank that clips
    // alone fails instead of training on to other parameters than its peers.
    for backend in [Backend::Threads, Backend::Tcp] {
        for (world, strategy) in [
            (2, ShardingStrategy::NoShard),
            (3, ShardingStrategy::NoShard),
            (2, ShardingStrategy::HybridShard),
            (4, ShardingStrategy::FullShard),
        ] {
            let (out, elapsed) = run(backend, world, |r, pg| {
                let quirks = Quirks {
                    clip: r == 0,
                    ..Quirks::default()
                };
                train_with(pg, strategy, 1, &[1, 1], quirks)
            });
            let what = format!("{backend:?} world {world} {strategy:?}");
            assert_named(
                &what,
                &out,
                elapsed,
                &["clip_grad_norm_ of unit root (step 0)"],
            );
        }
    }
}

#[test]
fn looking_at_optimizer_params_on_one_rank_is_no_divergence() {
    // optimizer_params() has no effect on the collectives (steps are counted by
    // zero_grad): rank 0 peeking at them after every backward trains like the others.
    let plain = run(Backend::Threads, 2, |_, pg| {
        train_with(
            pg,
            ShardingStrategy::FullShard,
            1,
            &[2, 2],
            Quirks {
                clip: true,
                ..Quirks::default()
            },
        )
    })
    .0;
    let (out, _) = run(Backend::Threads, 2, |r, pg| {
        let quirks = Quirks {
            clip: true,
            peek_params: r == 0,
            ..Quirks::default()
        };
        train_with(pg, ShardingStrategy::FullShard, 1, &[2, 2], quirks)
    });
    for (r, (got, want)) in out.iter().zip(&plain).enumerate() {
        assert_eq!(got.as_ref().unwrap(), want.as_ref().unwrap(), "rank {r}");
    }
}
