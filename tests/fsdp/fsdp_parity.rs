//! FSDP FullShard (and the other built strategies) give the same parameters as unsharded
//! training on the concatenated batch, at world sizes 1-4, with models whose sizes no world
//! size divides, for SGD and AdamW.

use crate::common;

use common::{assert_close, values};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, AutoWrapPolicy, FsdpConfig, FullyShardedDataParallel,
    ShardingStrategy,
};
use fsdp::nn::{loss, visit_parameters, Context, InitKey, Linear, Module, Sequential};
use fsdp::optim::{AdamConfig, AdamW, Optimizer, SgdConfig, SGD};
use fsdp::tensor::Tensor;
use std::sync::Arc;

const STEPS: usize = 3;

#[derive(Clone, Copy, Debug)]
enum Opt {
    Sgd,
    AdamW,
}

fn optimizer(o: Opt) -> Box<dyn Optimizer> {
    match o {
        // Momentum and weight decay so the state and the decay are exercised too.
        Opt::Sgd => Box::new(SGD::new(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
            ..Default::default()
        })),
        // eps 1e-3 instead of 1e-8: some GPT gradients are exactly zero in exact arithmetic
        // (the key bias: softmax ignores a per-row constant) and Adam with a tiny eps turns
        // their 1e-9 rounding noise into +-lr steps whose sign depends on summation order.
        // A larger eps keeps the test about sharding, not about amplified rounding noise.
        Opt::AdamW => Box::new(AdamW::new(AdamConfig {
            lr: 1e-2,
            eps: 1e-3,
            ..AdamConfig::adamw()
        })),
    }
}

/// A model family for the parity runs: how to build it, its input and loss for a row range.
trait Case: Sync {
    fn build(&self) -> Box<dyn Module>;
    fn unit_policy(&self) -> AutoWrapPolicy;
    fn rows(&self) -> usize;
    /// (input, loss gradient fn) for rows `lo..hi` of step `step`'s global batch.
    fn step_loss(&self, m: &mut dyn Module, step: usize, lo: usize, hi: usize) -> fsdp::Result<()>;
}

/// Linear(7,5,no bias) - GELU - Linear(5,7,no bias) - GELU - Linear(7,1,no bias):
/// 35 + 35 + 7 = 77 parameters; no unit size divisible by 2, 3 or 4.
struct Uneven;

impl Case for Uneven {
    fn build(&self) -> Box<dyn Module> {
        common::uneven_model(5)
    }
    fn unit_policy(&self) -> AutoWrapPolicy {
        transformer_auto_wrap_policy(["Linear"])
    }
    fn rows(&self) -> usize {
        12
    }
    fn step_loss(&self, m: &mut dyn Module, step: usize, lo: usize, hi: usize) -> fsdp::Result<()> {
        let x = values(100 + step as u64, 12 * 7);
        let y = values(200 + step as u64, 12);
        let xt = Tensor::from_vec(x[lo * 7..hi * 7].to_vec(), &[hi - lo, 7])?;
        let yt = Tensor::from_vec(y[lo..hi].to_vec(), &[hi - lo, 1])?;
        let out = m.forward(&xt, &Context::train())?;
        let (_, g) = loss::mse_loss(&out, &yt)?;
        m.backward(&g, &Context::train())?;
        Ok(())
    }
}

/// Linear(1, 1) with bias: 2 parameters, so at world size 3 and 4 some ranks own only
/// padding (empty shards).
struct Tiny;

impl Case for Tiny {
    fn build(&self) -> Box<dyn Module> {
        Box::new(Linear::new(1, 1, true, &InitKey::new(9)).unwrap())
    }
    fn unit_policy(&self) -> AutoWrapPolicy {
        transformer_auto_wrap_policy(["Linear"])
    }
    fn rows(&self) -> usize {
        12
    }
    fn step_loss(&self, m: &mut dyn Module, step: usize, lo: usize, hi: usize) -> fsdp::Result<()> {
        let x = values(300 + step as u64, 12);
        let xt = Tensor::from_vec(x[lo..hi].to_vec(), &[hi - lo, 1])?;
        let yt = Tensor::from_vec(
            x[lo..hi].iter().map(|v| 3.0 * v - 1.0).collect(),
            &[hi - lo, 1],
        )?;
        let out = m.forward(&xt, &Context::train())?;
        let (_, g) = loss::mse_loss(&out, &yt)?;
        m.backward(&g, &Context::train())?;
        Ok(())
    }
}

/// A small GPT (vocab 29, 2 blocks, width 12, 3 heads): tied embedding, attention, every
/// layer kind.
struct SmallGpt;

impl Case for SmallGpt {
    fn build(&self) -> Box<dyn Module> {
        common::small_gpt(2)
    }
    fn unit_policy(&self) -> AutoWrapPolicy {
        transformer_auto_wrap_policy(["Block"])
    }
    fn rows(&self) -> usize {
        12
    }
    fn step_loss(&self, m: &mut dyn Module, step: usize, lo: usize, hi: usize) -> fsdp::Result<()> {
        common::gpt_step(m, step, lo, hi)
    }
}

/// Unsharded reference: the whole batch on one model, parameters in named order.
fn reference(case: &dyn Case, opt: Opt) -> Vec<(String, Vec<f32>)> {
    let mut m = case.build();
    let mut o = optimizer(opt);
    for step in 0..STEPS {
        case.step_loss(m.as_mut(), step, 0, case.rows()).unwrap();
        o.step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        fsdp::nn::zero_grad(m.as_mut());
    }
    common::named_values(m.as_mut())
}

fn sharded(
    case: &dyn Case,
    opt: Opt,
    world: usize,
    strategy: ShardingStrategy,
    per_unit: bool,
) -> Vec<Vec<(String, Vec<f32>)>> {
    launch(&LaunchOptions::new(world), |pg: Group| {
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            auto_wrap_policy: per_unit.then(|| case.unit_policy()),
            ranks_per_node: strategy
                .is_hybrid()
                .then(|| common::hybrid_ranks_per_node(world)),
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(case.build(), pg.clone(), cfg)?;
        let mut o = optimizer(opt);
        let rows = case.rows() / world;
        for step in 0..STEPS {
            case.step_loss(&mut m, step, pg.rank() * rows, (pg.rank() + 1) * rows)?;
            o.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        m.full_parameters()
    })
    .unwrap()
}

fn check(case: &dyn Case, name: &str, strategies: &[ShardingStrategy]) {
    for opt in [Opt::Sgd, Opt::AdamW] {
        let want = reference(case, opt);
        for &strategy in strategies {
            for world in 1..=4 {
                for per_unit in [false, true] {
                    let all = sharded(case, opt, world, strategy, per_unit);
                    for (rank, got) in all.iter().enumerate() {
                        assert_eq!(got.len(), want.len());
                        for ((gn, gv), (wn, wv)) in got.iter().zip(&want) {
                            assert_eq!(gn, wn);
                            let what = format!("{name} {opt:?} {strategy:?} world {world} per_unit {per_unit} rank {rank} {gn}");
                            assert_close(&what, gv, wv, 1e-5, 1e-5);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn full_shard_matches_unsharded_on_an_uneven_model() {
    check(&Uneven, "uneven", &[ShardingStrategy::FullShard]);
}

#[test]
fn full_shard_matches_unsharded_with_empty_shards() {
    check(&Tiny, "tiny", &[ShardingStrategy::FullShard]);
}

#[test]
fn full_shard_matches_unsharded_on_a_gpt() {
    check(&SmallGpt, "gpt", &[ShardingStrategy::FullShard]);
}

#[test]
fn shard_grad_op_and_no_shard_match_unsharded() {
    check(
        &Uneven,
        "uneven",
        &[ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard],
    );
    check(
        &SmallGpt,
        "gpt",
        &[ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard],
    );
}

#[test]
fn hybrid_strategies_match_unsharded() {
    // World 2 = 2 nodes x 1 rank, 3 = 3 x 1, 4 = 2 nodes x 2 ranks.
    let hybrid = [
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ];
    check(&Uneven, "uneven", &hybrid);
    check(&SmallGpt, "gpt", &hybrid);
}

#[test]
fn hybrid_with_one_rank_per_node_keeps_replicas_bitwise_identical() {
    // Shard groups of one rank: every rank holds the whole model and all-reduces grads.
    let out = launch(&LaunchOptions::new(2), |pg| {
        let cfg = FsdpConfig {
            sharding_strategy: ShardingStrategy::HybridShard,
            ranks_per_node: Some(1),
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(Uneven.build(), pg.clone(), cfg)?;
        let mut o = optimizer(Opt::AdamW);
        Uneven.step_loss(&mut m, 0, pg.rank() * 6, (pg.rank() + 1) * 6)?;
        o.step(&m.optimizer_params())?;
        Ok((m.shard_group().size(), m.full_parameters()?))
    })
    .unwrap();
    assert_eq!(out[0].0, 1);
    let bits = |v: &Vec<(String, Vec<f32>)>| {
        v.iter()
            .flat_map(|(_, x)| x.iter().map(|f| f.to_bits()))
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&out[0].1), bits(&out[1].1));
    let want = {
        let mut m = Uneven.build();
        let mut o = optimizer(Opt::AdamW);
        Uneven.step_loss(m.as_mut(), 0, 0, 12).unwrap();
        o.step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        let mut v = Vec::new();
        visit_parameters(m.as_mut(), "", false, &mut |_, p| {
            v.extend(p.data().unwrap().to_vec_f32().unwrap());
            Ok(())
        })
        .unwrap();
        v
    };
    let got: Vec<f32> = out[0].1.iter().flat_map(|(_, v)| v.clone()).collect();
    assert_close("hybrid 2 x 1 vs unsharded", &got, &want, 1e-5, 1e-5);
}

#[test]
fn training_actually_moves_the_parameters() {
    // Guards the parity tests against comparing two untouched models.
    let mut fresh = Uneven.build();
    let mut before = Vec::new();
    visit_parameters(fresh.as_mut(), "", false, &mut |_, p| {
        before.extend(p.data().unwrap().to_vec_f32().unwrap());
        Ok(())
    })
    .unwrap();
    let after: Vec<f32> = reference(&Uneven, Opt::AdamW)
        .into_iter()
        .flat_map(|(_, v)| v)
        .collect();
    let moved = before
        .iter()
        .zip(&after)
        .filter(|(a, b)| (*a - *b).abs() > 1e-3)
        .count();
    assert!(
        moved > before.len() / 2,
        "only {moved} of {} parameters moved",
        before.len()
    );
}

#[test]
fn shards_split_the_flat_parameter_with_padding_at_the_end() {
    // Linear(7, 1, no bias) + Linear(1, 1): one unit of 7 + 2 = 9 elements at 4 ranks:
    // chunk ceil(9/4) = 3, so ranks own 3, 3, 3 and 0 real elements (rank 3 only padding).
    let out = launch(&LaunchOptions::new(4), |pg| {
        let k = InitKey::new(1);
        let model = Sequential::new(vec![
            Box::new(Linear::new(7, 1, false, &k.child("0"))?),
            Box::new(Linear::new(1, 1, true, &k.child("1"))?),
        ]);
        let m = FullyShardedDataParallel::new(Box::new(model), pg, FsdpConfig::default())?;
        let f = m.flat_param();
        Ok((
            f.numel(),
            f.shard_numel(),
            f.valid_shard_numel(),
            f.local_shard().to_vec_f32()?,
            f.param_infos()
                .iter()
                .map(|i| (i.fqn.clone(), i.offset))
                .collect::<Vec<_>>(),
        ))
    })
    .unwrap();
    let valid: Vec<usize> = out.iter().map(|o| o.2).collect();
    assert_eq!(valid, vec![3, 3, 3, 0]);
    assert!(out.iter().all(|o| o.0 == 9 && o.1 == 3));
    assert_eq!(
        out[3].3,
        vec![0.0; 3],
        "the last rank holds only zero padding"
    );
    assert_eq!(
        out[0].4,
        vec![
            ("0.weight".to_string(), 0),
            ("1.weight".to_string(), 7),
            ("1.bias".to_string(), 8)
        ]
    );
    // The shards concatenate to the unsharded values.
    let mut m = Sequential::new(vec![
        Box::new(Linear::new(7, 1, false, &InitKey::new(1).child("0")).unwrap()),
        Box::new(Linear::new(1, 1, true, &InitKey::new(1).child("1")).unwrap()),
    ]);
    let mut flat = Vec::new();
    visit_parameters(&mut m, "", false, &mut |_, p| {
        flat.extend(p.data().unwrap().to_vec_f32().unwrap());
        Ok(())
    })
    .unwrap();
    let cat: Vec<f32> = out.iter().flat_map(|o| o.3.clone()).take(9).collect();
    assert_eq!(cat, flat);
}

#[test]
fn parameters_are_freed_between_forward_and_backward_under_full_shard() {
    let states = launch(&LaunchOptions::new(2), |pg| {
        let k = InitKey::new(2);
        let model = Sequential::new(vec![
            Box::new(Linear::new(3, 3, true, &k.child("0"))?),
            Box::new(Linear::new(3, 2, true, &k.child("1"))?),
        ]);
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Linear"])),
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(Box::new(model), pg, cfg)?;
        m.forward(
            &Tensor::from_vec(vec![1.0f32; 6], &[2, 3])?,
            &Context::train(),
        )?;
        let s = m.memory_stats();
        // Root (no params of its own here) stays unsharded; both Linear units were freed.
        let mut materialized = Vec::new();
        visit_parameters(&mut m, "", false, &mut |n, p| {
            materialized.push((n.to_string(), p.is_materialized()));
            Ok(())
        })
        .unwrap();
        Ok((s.unsharded_units, s.peak_unsharded_units, materialized))
    })
    .unwrap();
    for (units, peak, mat) in states {
        assert_eq!(units, 1, "only the root stays unsharded after forward");
        assert_eq!(peak, 2, "root + one Linear at a time");
        assert!(mat.iter().all(|(_, m)| !m), "{mat:?}");
    }
    let _ = Arc::new(0);
}
