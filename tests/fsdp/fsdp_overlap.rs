//! Communication overlap: asynchronous collectives on a CommStream, and FSDP's prefetching
//! (backward_prefetch, forward_prefetch, limit_all_gathers), which must change when
//! parameters are gathered but never the numbers.

use crate::common;

use common::values;
use fsdp::distributed::{launch, CommStream, Group, LaunchOptions, ReduceOp};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, AutoWrapPolicy, BackwardPrefetch, FsdpConfig,
    FullyShardedDataParallel, RuntimeStats, ShardingStrategy,
};
use fsdp::nn::{loss, Context, InitKey, Linear, Module, Sequential, GELU};
use fsdp::optim::{AdamConfig, AdamW, Optimizer};
use fsdp::tensor::Tensor;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

#[test]
fn an_async_all_reduce_is_in_flight_while_the_rank_computes() {
    // Rank 1 joins the all-reduce only after rank 0 has issued it, checked that it is not
    // complete, and computed something: the issue must not block.
    let (tx, rx) = mpsc::channel::<()>();
    let rx = Arc::new(Mutex::new(rx));
    let out = launch(&LaunchOptions::new(2), move |pg: Group| {
        let t = Tensor::from_vec(vec![pg.rank() as f32 + 1.0; 5], &[5])?;
        if pg.rank() == 0 {
            let stream = CommStream::new("test-comm")?;
            let work = stream.all_reduce(&pg, &t, ReduceOp::Sum);
            let in_flight = !work.is_completed();
            let computed: f32 = values(1, 1000).iter().map(|v| v * v).sum();
            tx.send(()).unwrap();
            work.wait()?;
            Ok((in_flight, computed > 0.0, t.to_vec_f32()?))
        } else {
            rx.lock().unwrap().recv().unwrap();
            pg.all_reduce(&t, ReduceOp::Sum)?;
            Ok((true, true, t.to_vec_f32()?))
        }
    })
    .unwrap();
    assert!(
        out[0].0,
        "the async all-reduce completed before rank 1 joined"
    );
    assert!(out[0].1);
    for (_, _, v) in &out {
        assert_eq!(v, &vec![3.0; 5]);
    }
}

#[test]
fn an_async_mismatch_fails_on_wait_naming_the_ranks() {
    let errs = launch(&LaunchOptions::new(2), |pg: Group| {
        let stream = CommStream::new("test-comm")?;
        let n = 3 + pg.rank();
        let t = Tensor::zeros(&[n], fsdp::tensor::DType::F32);
        Ok(stream
            .all_reduce(&pg, &t, ReduceOp::Sum)
            .wait()
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    for e in errs {
        assert!(e.contains("rank 0") && e.contains("rank 1"), "{e}");
    }
}

#[derive(Clone, Copy, Debug)]
struct Prefetch {
    backward: Option<BackwardPrefetch>,
    forward: bool,
    limit: bool,
}

type Run = (Vec<u32>, RuntimeStats, usize);

/// 3 AdamW steps of the GPT, per-block units; returns (parameter bits, stats, peak units).
fn train(world: usize, strategy: ShardingStrategy, p: Prefetch) -> Vec<Run> {
    launch(&LaunchOptions::new(world), |pg: Group| {
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
            ranks_per_node: strategy
                .is_hybrid()
                .then(|| common::hybrid_ranks_per_node(world)),
            backward_prefetch: p.backward,
            forward_prefetch: p.forward,
            limit_all_gathers: p.limit,
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(common::small_gpt(3), pg.clone(), cfg)?;
        let mut opt = AdamW::new(AdamConfig {
            lr: 1e-2,
            ..AdamConfig::adamw()
        });
        let rows = 12 / world;
        for step in 0..3 {
            common::gpt_step(&mut m, step, pg.rank() * rows, (pg.rank() + 1) * rows)?;
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        let bits = m
            .full_parameters()?
            .into_iter()
            .flat_map(|(_, v)| v.into_iter().map(f32::to_bits))
            .collect();
        Ok((
            bits,
            m.runtime_stats(),
            m.memory_stats().peak_unsharded_units,
        ))
    })
    .unwrap()
}

#[test]
fn every_prefetch_setting_gives_bitwise_the_same_training() {
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::HybridShard,
    ] {
        for world in [2, 3, 4] {
            let none = Prefetch {
                backward: None,
                forward: false,
                limit: false,
            };
            let base = train(world, strategy, none);
            assert_eq!(base[0].1.prefetched_all_gathers, 0);
            for backward in [
                None,
                Some(BackwardPrefetch::BackwardPre),
                Some(BackwardPrefetch::BackwardPost),
            ] {
                for forward in [false, true] {
                    for limit in [false, true] {
                        let p = Prefetch {
                            backward,
                            forward,
                            limit,
                        };
                        let got = train(world, strategy, p);
                        for (rank, (bits, stats, _)) in got.iter().enumerate() {
                            assert_eq!(bits, &base[rank].0, "{strategy:?} world {world} {p:?}");
                            assert_eq!(stats.unused_prefetches, 0, "{p:?}");
                            // FullShard frees blocks after forward, so backward prefetch has
                            // work to do; forward prefetch works from step 2 on.
                            let expect_prefetch = (forward
                                || (backward.is_some()
                                    && strategy != ShardingStrategy::ShardGradOp))
                                && strategy != ShardingStrategy::NoShard;
                            assert_eq!(
                                stats.prefetched_all_gathers > 0,
                                expect_prefetch,
                                "{strategy:?} {p:?}: {stats:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Root -> [outer: Sequential(Linear a, GELU, Linear b), Linear c], every Linear and the
/// inner Sequential its own unit.
fn nested() -> Box<dyn Module> {
    let k = InitKey::new(4);
    Box::new(Sequential::new(vec![
        Box::new(Sequential::new(vec![
            Box::new(Linear::new(6, 6, true, &k.child("0.0")).unwrap()),
            Box::new(GELU::new()),
            Box::new(Linear::new(6, 6, true, &k.child("0.2")).unwrap()),
        ])),
        Box::new(Linear::new(6, 2, true, &k.child("1")).unwrap()),
    ]))
}

fn peak_units(limit: bool) -> Vec<(usize, RuntimeStats)> {
    launch(&LaunchOptions::new(2), |pg: Group| {
        let policy: AutoWrapPolicy = AutoWrapPolicy::Custom(Arc::new(|m: &dyn Module, _| {
            matches!(m.type_name(), "Linear" | "Sequential")
        }));
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(policy),
            forward_prefetch: true,
            limit_all_gathers: limit,
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(nested(), pg.clone(), cfg)?;
        let x = Tensor::from_vec(values(3, 4 * 6), &[4, 6])?;
        let y = Tensor::from_vec(values(4, 4 * 2), &[4, 2])?;
        for _ in 0..2 {
            m.reset_peak_memory_stats();
            let out = m.forward(&x, &Context::train())?;
            let (_, g) = loss::mse_loss(&out, &y)?;
            m.backward(&g, &Context::train())?;
        }
        Ok((m.memory_stats().peak_unsharded_units, m.runtime_stats()))
    })
    .unwrap()
}

#[test]
fn limit_all_gathers_bounds_the_units_unsharded_at_once() {
    // In the second iteration forward prefetch knows the order: while the outer unit and
    // Linear a are unsharded, Linear b would be prefetched too (root + 3). The limit allows
    // two units besides the root.
    for (peak, stats) in peak_units(false) {
        assert_eq!(peak, 4, "{stats:?}");
    }
    for (peak, stats) in peak_units(true) {
        assert_eq!(peak, 3, "{stats:?}");
        assert!(stats.prefetched_all_gathers > 0);
    }
}

#[test]
fn every_collective_has_an_async_form_with_the_blocking_result() {
    use fsdp::distributed::CollectivesExt;
    let out = launch(&LaunchOptions::new(3), |pg: Group| {
        let s = CommStream::new("test-comm")?;
        let r = pg.rank() as f32;
        let mk = |v: Vec<f32>| Tensor::from_vec(v.clone(), &[v.len()]);
        // Each op twice: async on the stream, then blocking, on equal inputs.
        let a = [mk(vec![r + 1.0; 2])?, mk(vec![r + 1.0; 2])?];
        let gathered = [mk(vec![0.0; 6])?, mk(vec![0.0; 6])?];
        let lists: Vec<Vec<Tensor>> = (0..2)
            .map(|_| {
                (0..3)
                    .map(|_| Tensor::zeros(&[2], fsdp::tensor::DType::F32))
                    .collect()
            })
            .collect();
        let a2a_in = mk((0..3).map(|j| 10.0 * r + j as f32).collect())?;
        let a2a = [mk(vec![0.0; 3])?, mk(vec![0.0; 3])?];
        let works = vec![
            s.reduce(&pg, &a[0], 1, ReduceOp::Sum),
            s.all_gather(&pg, &lists[0], &mk(vec![r; 2])?),
            s.all_gather_into_tensor(&pg, &gathered[0], &mk(vec![r; 2])?),
            s.all_to_all_single(&pg, &a2a[0], &a2a_in),
            s.barrier(&pg),
        ];
        for w in works {
            w.wait()?;
        }
        pg.reduce(&a[1], 1, ReduceOp::Sum)?;
        pg.all_gather(&lists[1], &mk(vec![r; 2])?)?;
        pg.all_gather_into_tensor(&gathered[1], &mk(vec![r; 2])?)?;
        pg.all_to_all_single(&a2a[1], &a2a_in)?;
        let v = |t: &Tensor| t.to_vec_f32().unwrap();
        let same = v(&a[0]) == v(&a[1])
            && lists[0].iter().map(v).eq(lists[1].iter().map(v))
            && v(&gathered[0]) == v(&gathered[1])
            && v(&a2a[0]) == v(&a2a[1]);
        Ok((same, v(&a[0]), v(&a2a[0])))
    })
    .unwrap();
    for (rank, (same, reduced, a2a)) in out.iter().enumerate() {
        assert!(same, "rank {rank}");
        let want = if rank == 1 {
            vec![6.0; 2]
        } else {
            vec![rank as f32 + 1.0; 2]
        };
        assert_eq!(reduced, &want);
        assert_eq!(
            a2a,
            &(0..3)
                .map(|j| 10.0 * j as f32 + rank as f32)
                .collect::<Vec<_>>()
        );
    }
}
