//! State dicts in memory: FULL and SHARDED taken at world size 4 load at 1, 2, 3 and 4
//! (under other strategies) and gather back bitwise, Adam moments and steps included;
//! LOCAL refuses another world size; bad entries are refused before anything changes;
//! loading between a forward and its backward is refused; summon_full_params.

use crate::common;

use common::{assert_close, values};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullStateDict, FullStateDictConfig,
    FullyShardedDataParallel, OptimStateDict, ShardedStateDict, ShardingStrategy, StateDict,
    StateDictConfig,
};
use fsdp::nn::{loss, visit_parameters, Context, GptConfig, Module, GPT};
use fsdp::optim::{AdamConfig, AdamW, Optimizer, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};

const ROWS: usize = 12;
const T: usize = 6;

fn gpt(seed: u64) -> Box<dyn Module> {
    let cfg = GptConfig {
        vocab_size: 29,
        block_size: T,
        n_layer: 2,
        n_head: 3,
        n_embd: 12,
    };
    Box::new(GPT::new(cfg, seed).unwrap())
}

fn wrap(
    pg: Group,
    strategy: ShardingStrategy,
    seed: u64,
) -> fsdp::Result<FullyShardedDataParallel> {
    let cfg = FsdpConfig {
        sharding_strategy: strategy,
        auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
        ranks_per_node: strategy.is_hybrid().then_some(2),
        ..Default::default()
    };
    FullyShardedDataParallel::new(gpt(seed), pg, cfg)
}

/// One training step on this rank's rows of the global batch of `step`.
fn train_step(
    m: &mut FullyShardedDataParallel,
    opt: &mut dyn Optimizer,
    pg: &Group,
    step: u64,
) -> fsdp::Result<()> {
    let rows = ROWS / pg.size();
    let (lo, hi) = (pg.rank() * rows, (pg.rank() + 1) * rows);
    let toks: Vec<i32> = values(400 + step, ROWS * (T + 1))
        .iter()
        .map(|v| ((v + 1.0) * 14.4) as i32 % 29)
        .collect();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for r in lo..hi {
        x.extend_from_slice(&toks[r * (T + 1)..r * (T + 1) + T]);
        y.extend_from_slice(&toks[r * (T + 1) + 1..(r + 1) * (T + 1)]);
    }
    let logits = m.forward(&Tensor::from_vec(x, &[hi - lo, T])?, &Context::train())?;
    let (_, g) = loss::cross_entropy(&logits, &Tensor::from_vec(y, &[hi - lo, T])?)?;
    m.backward(&g, &Context::train())?;
    opt.step(&m.optimizer_params())?;
    m.zero_grad();
    Ok(())
}

fn adamw() -> AdamW {
    AdamW::new(AdamConfig {
        lr: 1e-2,
        ..AdamConfig::adamw()
    })
}

fn full() -> StateDictConfig {
    StateDictConfig::Full(FullStateDictConfig::default())
}

fn assert_full_eq(what: &str, got: &FullStateDict, want: &FullStateDict) {
    let names = |d: &FullStateDict| d.tensors.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{what}: keys");
    for ((n, g), (_, w)) in got.tensors.iter().zip(&want.tensors) {
        assert_eq!(g.shape(), w.shape(), "{what}: '{n}' shape");
        assert!(
            common::f32_bits(g) == common::f32_bits(w),
            "{what}: '{n}' differs"
        );
    }
}

fn full_of(sd: &StateDict) -> &FullStateDict {
    match sd {
        StateDict::Full(f) => f,
        _ => panic!("not a full state dict"),
    }
}

fn assert_optim_eq(what: &str, got: &OptimStateDict, want: &OptimStateDict) {
    assert_eq!(got.kind, want.kind, "{what}");
    let sorted = |d: &OptimStateDict| {
        let mut s = d.steps.clone();
        s.sort();
        s
    };
    assert_eq!(sorted(got), sorted(want), "{what}: steps");
    assert!(!want.steps.is_empty());
    for (name, w) in &want.buffers {
        let g = got
            .buffer(name)
            .unwrap_or_else(|| panic!("{what}: no '{name}'"));
        assert_full_eq(&format!("{what} {name}"), full_of(g), full_of(w));
    }
}

/// What the world-size-4 run saved: full and merged sharded dicts of model and optimizer,
/// and the full parameters after one more step.
struct Saved {
    model: FullStateDict,
    optim: OptimStateDict,
    sharded: ShardedStateDict,
    sharded_optim: OptimStateDict,
    next: FullStateDict,
}

fn save_at_4() -> Saved {
    let out = launch(&LaunchOptions::new(4), |pg: Group| {
        let mut m = wrap(pg.clone(), ShardingStrategy::FullShard, 3)?;
        let mut opt = adamw();
        for step in 0..3 {
            train_step(&mut m, &mut opt, &pg, step)?;
        }
        let model = full_of(&m.state_dict(full())?).clone();
        let optim = m.optim_state_dict(&opt, full())?;
        let sharded = m.sharded_state_dict()?;
        let sharded_optim = m.optim_state_dict(&opt, StateDictConfig::Sharded)?;
        train_step(&mut m, &mut opt, &pg, 3)?;
        let next = full_of(&m.state_dict(full())?).clone();
        Ok((model, optim, sharded, sharded_optim, next))
    })
    .unwrap();
    let sharded =
        ShardedStateDict::merge(&out.iter().map(|o| o.2.clone()).collect::<Vec<_>>()).unwrap();
    let sharded_optim =
        OptimStateDict::merge(&out.iter().map(|o| o.3.clone()).collect::<Vec<_>>()).unwrap();
    let (model, optim, _, _, next) = out.into_iter().next().unwrap();
    Saved {
        model,
        optim,
        sharded,
        sharded_optim,
        next,
    }
}

#[test]
fn full_and_sharded_state_dicts_from_world_size_4_load_at_1_2_3_4_bitwise() {
    let saved = save_at_4();
    // Tied output projection: GPT registers wte once, so one entry.
    assert_eq!(saved.model.tensors[0].0, "wte.weight");
    assert_eq!(saved.optim.kind, "AdamW");
    assert!(saved.optim.steps.iter().all(|(_, s)| *s == 3));
    for (w, strategy) in [
        (1, ShardingStrategy::FullShard),
        (2, ShardingStrategy::ShardGradOp),
        (3, ShardingStrategy::NoShard),
        (4, ShardingStrategy::HybridShard),
        (3, ShardingStrategy::FullShard),
    ] {
        for sharded in [false, true] {
            let what = format!(
                "{} at world size {w}, {strategy:?}",
                if sharded { "sharded" } else { "full" }
            );
            let out = launch(&LaunchOptions::new(w), |pg: Group| {
                let mut m = wrap(pg.clone(), strategy, 77)?;
                let mut opt = adamw();
                if sharded {
                    m.load_state_dict(&StateDict::Sharded(saved.sharded.clone()), true)?;
                    m.load_optim_state_dict(&mut opt, &saved.sharded_optim)?;
                } else {
                    m.load_state_dict(&StateDict::Full(saved.model.clone()), true)?;
                    m.load_optim_state_dict(&mut opt, &saved.optim)?;
                }
                let model = full_of(&m.state_dict(full())?).clone();
                let optim = m.optim_state_dict(&opt, full())?;
                train_step(&mut m, &mut opt, &pg, 3)?;
                let next = full_of(&m.state_dict(full())?).clone();
                Ok((model, optim, next))
            })
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            for (rank, (model, optim, next)) in out.iter().enumerate() {
                assert_full_eq(&format!("{what} rank {rank}"), model, &saved.model);
                assert_optim_eq(&format!("{what} rank {rank}"), optim, &saved.optim);
                // The restored moments and steps drive the next step as at world size 4 (up
                // to summation order: Adam's normalized update amplifies the rounding of
                // near-zero gradients, so the bound is 1% of lr; a misplaced moment moves
                // an element by about lr).
                for ((n, g), (_, want)) in next.tensors.iter().zip(&saved.next.tensors) {
                    let (g, want) = (g.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
                    assert_close(
                        &format!("{what}: '{n}' after a step"),
                        &g,
                        &want,
                        1e-4,
                        1e-4,
                    );
                }
            }
        }
    }
}

#[test]
fn local_state_dict_round_trips_at_its_world_size_and_refuses_another() {
    let locals = launch(&LaunchOptions::new(4), |pg: Group| {
        let mut m = wrap(pg.clone(), ShardingStrategy::FullShard, 3)?;
        let local = m.local_state_dict()?;
        let mut fresh = wrap(pg.clone(), ShardingStrategy::FullShard, 9)?;
        fresh.load_state_dict(&StateDict::Local(local.clone()), true)?;
        let a = full_of(&m.state_dict(full())?).clone();
        let b = full_of(&fresh.state_dict(full())?).clone();
        assert_full_eq("local round trip", &b, &a);
        Ok(local)
    })
    .unwrap();
    assert_eq!((locals[1].world_size, locals[1].rank), (4, 1));
    let errs = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = wrap(pg.clone(), ShardingStrategy::FullShard, 9)?;
        let before = full_of(&m.state_dict(full())?).clone();
        let e = m
            .load_state_dict(&StateDict::Local(locals[pg.rank()].clone()), true)
            .unwrap_err()
            .to_string();
        let after = full_of(&m.state_dict(full())?).clone();
        assert_full_eq("untouched", &after, &before);
        Ok(e)
    })
    .unwrap();
    for e in errs {
        assert!(
            e.contains("world size 4")
                && e.contains("world size 2")
                && e.contains("LOCAL_STATE_DICT"),
            "{e}"
        );
    }
}

/// Loads `sd` strictly and returns the error text, checking nothing changed.
fn refused(sd: StateDict) -> String {
    let out = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = wrap(pg, ShardingStrategy::FullShard, 9)?;
        let before = full_of(&m.state_dict(full())?).clone();
        let e = m.load_state_dict(&sd, true).unwrap_err().to_string();
        assert_full_eq(
            "after a refused load",
            full_of(&m.state_dict(full())?),
            &before,
        );
        Ok(e)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn wrong_shape_dtype_missing_and_unexpected_keys_are_refused_naming_the_parameter() {
    let saved = launch(&LaunchOptions::new(1), |pg: Group| {
        let mut m = wrap(pg, ShardingStrategy::FullShard, 3)?;
        Ok(full_of(&m.state_dict(full())?).clone())
    })
    .unwrap()
    .remove(0);
    let name = "blocks.0.attn.c_attn.weight";
    let idx = saved
        .tensors
        .iter()
        .position(|(n, _)| n == name)
        .expect(name);
    let shape = saved.tensors[idx].1.shape().to_vec();

    let mut bad = saved.clone();
    bad.tensors[idx].1 = Tensor::zeros(&[shape[1], shape[0]], DType::F32);
    let e = refused(StateDict::Full(bad));
    assert!(
        e.contains(name) && e.contains(&format!("expected shape {shape:?}")),
        "{e}"
    );
    assert!(e.contains("nothing was modified"), "{e}");

    let mut bad = saved.clone();
    bad.tensors[idx].1 = saved.tensors[idx].1.to_dtype(DType::BF16).unwrap();
    let e = refused(StateDict::Full(bad));
    assert!(
        e.contains(name) && e.contains("expected dtype f32 or f64, got bf16"),
        "{e}"
    );

    let mut bad = saved.clone();
    bad.tensors.remove(idx);
    let e = refused(StateDict::Full(bad.clone()));
    assert!(
        e.contains("missing key") && e.contains(name) && e.contains(&format!("{shape:?}")),
        "{e}"
    );

    let mut extra = saved.clone();
    extra
        .tensors
        .push(("head.bias".into(), Tensor::zeros(&[3], DType::F32)));
    let e = refused(StateDict::Full(extra.clone()));
    assert!(
        e.contains("unexpected key") && e.contains("'head.bias'"),
        "{e}"
    );

    // Non-strict: the missing parameter keeps its value, the extra key is reported.
    let keys = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = wrap(pg, ShardingStrategy::FullShard, 9)?;
        let before = full_of(&m.state_dict(full())?).clone();
        let mut sd = bad.clone();
        sd.tensors
            .push(("head.bias".into(), Tensor::zeros(&[3], DType::F32)));
        let keys = m.load_state_dict(&StateDict::Full(sd), false)?;
        let after = full_of(&m.state_dict(full())?).clone();
        assert!(
            common::f32_bits(after.get(name).unwrap())
                == common::f32_bits(before.get(name).unwrap())
        );
        assert!(
            common::f32_bits(after.get("wte.weight").unwrap())
                == common::f32_bits(saved.get("wte.weight").unwrap())
        );
        Ok(keys)
    })
    .unwrap()
    .remove(0);
    assert_eq!(keys.missing_keys, vec![name.to_string()]);
    assert_eq!(keys.unexpected_keys, vec!["head.bias".to_string()]);

    // A sharded state dict holding only rank 0's pieces of a world of 2 does not cover
    // the chunks of a world of 3: refused, naming the parameter and the ranks at hand.
    let rank0 = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = wrap(pg, ShardingStrategy::FullShard, 3)?;
        m.sharded_state_dict()
    })
    .unwrap()
    .remove(0);
    let errs = launch(&LaunchOptions::new(3), |pg: Group| {
        let mut m = wrap(pg, ShardingStrategy::FullShard, 9)?;
        Ok(m.load_state_dict(&StateDict::Sharded(rank0.clone()), true)
            .map_err(|e| e.to_string())
            .err())
    })
    .unwrap();
    let e = errs
        .into_iter()
        .flatten()
        .next()
        .expect("some rank refuses");
    assert!(
        e.contains("in no piece at hand") && e.contains("ranks [0]"),
        "{e}"
    );
}

#[test]
fn loading_between_a_forward_and_its_backward_is_refused() {
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ] {
        launch(&LaunchOptions::new(2), |pg: Group| {
            let mut m = wrap(pg.clone(), strategy, 3)?;
            let sd = m.state_dict(full())?;
            let x = Tensor::from_vec(vec![1i32; 2 * T], &[2, T])?;
            let logits = m.forward(&x, &Context::train())?;
            let e = m.load_state_dict(&sd, true).unwrap_err().to_string();
            assert!(
                e.contains("between a forward and its backward"),
                "{strategy:?}: {e}"
            );
            let e = m
                .summon_full_params(false, |_| Ok(()))
                .unwrap_err()
                .to_string();
            assert!(e.contains("between a forward and its backward"), "{e}");
            let (_, g) = loss::sum_loss(&logits)?;
            m.backward(&g, &Context::train())?;
            m.load_state_dict(&sd, true)?;
            // An eval forward leaves no backward pending.
            m.forward(&x, &Context::eval())?;
            m.load_state_dict(&sd, true).map(drop)
        })
        .unwrap();
    }
}

#[test]
fn summon_full_params_reads_whole_parameters_and_writes_back_the_local_chunk() {
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::NoShard] {
        let out = launch(&LaunchOptions::new(3), |pg: Group| {
            let mut m = wrap(pg.clone(), strategy, 3)?;
            let want = full_of(&m.state_dict(full())?).clone();
            // Read: whole values under every name; a forward inside is refused.
            m.summon_full_params(false, |m| {
                let mut seen = 0;
                visit_parameters(m.module_mut(), "", false, &mut |n, p| {
                    let v = p.data().unwrap().to_vec_f32().unwrap();
                    assert_eq!(v, want.get(n).unwrap().to_vec_f32().unwrap(), "{n}");
                    p.data().unwrap().f32_mut().unwrap().fill(0.5); // discarded
                    seen += 1;
                    Ok(())
                })
                .unwrap();
                assert_eq!(seen, want.len());
                let x = Tensor::from_vec(vec![1i32; T], &[1, T])?;
                let e = m.forward(&x, &Context::eval()).unwrap_err().to_string();
                assert!(e.contains("inside summon_full_params"), "{e}");
                Ok(())
            })?;
            let same = full_of(&m.state_dict(full())?).clone();
            assert_full_eq("writeback false", &same, &want);
            m.summon_full_params(true, |m| {
                visit_parameters(m.module_mut(), "", false, &mut |_, p| {
                    let d = p.data().unwrap();
                    let mut v = d.f32_mut().unwrap();
                    v.iter_mut().for_each(|x| *x = 2.0 * *x + 1.0);
                    Ok(())
                })
                .unwrap();
                Ok(())
            })?;
            let after = full_of(&m.state_dict(full())?).clone();
            // Parameters are sharded again, and training still works.
            let mut opt = SGD::new(SgdConfig::default());
            train_step(&mut m, &mut opt, &pg, 0)?;
            Ok((want, after))
        })
        .unwrap();
        for (want, after) in out {
            for ((n, a), (_, w)) in after.tensors.iter().zip(&want.tensors) {
                let w: Vec<f32> = w
                    .to_vec_f32()
                    .unwrap()
                    .iter()
                    .map(|x| 2.0 * x + 1.0)
                    .collect();
                assert_eq!(a.to_vec_f32().unwrap(), w, "{strategy:?}: '{n}'");
            }
        }
    }
}

#[test]
fn sgd_momentum_buffers_round_trip_across_world_sizes() {
    let sgd = || {
        SGD::new(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        })
    };
    let (model, optim) = launch(&LaunchOptions::new(3), |pg: Group| {
        let mut m = wrap(pg.clone(), ShardingStrategy::FullShard, 3)?;
        let mut opt = sgd();
        train_step(&mut m, &mut opt, &pg, 0)?;
        Ok((m.state_dict(full())?, m.optim_state_dict(&opt, full())?))
    })
    .unwrap()
    .remove(0);
    assert!(optim.steps.is_empty() && optim.buffer("momentum_buffer").is_some());
    launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = wrap(pg, ShardingStrategy::ShardGradOp, 9)?;
        let mut opt = sgd();
        m.load_state_dict(&model, true)?;
        m.load_optim_state_dict(&mut opt, &optim)?;
        let back = m.optim_state_dict(&opt, full())?;
        let (StateDict::Full(a), StateDict::Full(b)) = (
            back.buffer("momentum_buffer").unwrap(),
            optim.buffer("momentum_buffer").unwrap(),
        ) else {
            panic!("not full")
        };
        assert_full_eq("momentum", a, b);
        // Loading Adam state into SGD is refused.
        let adam = AdamW::new(AdamConfig::adamw());
        let e = m
            .optim_state_dict(&adam, full())
            .and_then(|o| m.load_optim_state_dict(&mut opt, &o))
            .unwrap_err()
            .to_string();
        assert!(e.contains("AdamW") && e.contains("SGD"), "{e}");
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_tied_parameter_appears_under_each_name_as_in_torch() {
    use fsdp::nn::{Embedding, InitKey, Linear, Sequential};
    let tied = || -> Box<dyn Module> {
        let k = InitKey::new(21);
        let emb = Embedding::new(10, 4, 1.0, &k.child("0")).unwrap();
        let mut head = Linear::new(4, 10, false, &k.child("1")).unwrap();
        head.weight.tie_to(&emb.weight).unwrap();
        Box::new(Sequential::new(vec![Box::new(emb), Box::new(head)]))
    };
    launch(&LaunchOptions::new(3), |pg: Group| {
        let mut m = FullyShardedDataParallel::new(tied(), pg, FsdpConfig::default())?;
        let sd = full_of(&m.state_dict(full())?).clone();
        let names: Vec<&str> = sd.tensors.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["0.weight", "1.weight"]);
        assert!(common::f32_bits(&sd.tensors[0].1) == common::f32_bits(&sd.tensors[1].1));
        let sharded = m.sharded_state_dict()?;
        assert_eq!(sharded.tensors.len(), 2);
        let mut one = sd.clone();
        one.tensors.pop();
        let e = m
            .load_state_dict(&StateDict::Full(one), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing key") && e.contains("'1.weight'"), "{e}");
        m.load_state_dict(&StateDict::Full(sd), true).map(drop)
    })
    .unwrap();
}
