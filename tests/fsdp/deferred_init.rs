//! Deferred initialization: models built on the meta device, materialized shard by shard
//! by FSDP (or by a param_init_fn), identical for every world size and to eager init.

use crate::common;
use common::STRATEGIES;

use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel, ParamInitFn,
    ShardingStrategy,
};
use fsdp::nn::{
    materialize, on_meta_device, visit_parameters, GptConfig, InitKey, Linear, Module, Parameter,
    Sequential, GPT,
};
use fsdp::tensor::Tensor;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

fn gpt_config() -> GptConfig {
    GptConfig {
        vocab_size: 31,
        block_size: 8,
        n_layer: 3,
        n_head: 2,
        n_embd: 10,
    }
}

fn bits(v: &[(String, Vec<f32>)]) -> Vec<(String, Vec<u32>)> {
    v.iter()
        .map(|(n, x)| (n.clone(), x.iter().map(|f| f.to_bits()).collect()))
        .collect()
}

fn eager() -> Vec<(String, Vec<f32>)> {
    let mut m = GPT::new(gpt_config(), 7).unwrap();
    common::named_values(&mut m)
}

#[test]
fn a_meta_gpt_sharded_at_any_world_size_has_the_eager_full_state_dict_bitwise() {
    let want = bits(&eager());
    for world in 1..=4 {
        for per_block in [false, true] {
            let out = launch(&LaunchOptions::new(world), |pg: Group| {
                let model = on_meta_device(|| GPT::new(gpt_config(), 7))?;
                let mut meta_params = 0;
                let mut m = model;
                visit_parameters(&mut m, "", false, &mut |_, p| {
                    meta_params +=
                        usize::from(p.data().unwrap().device() == fsdp::backend::Device::Meta);
                    Ok(())
                })
                .unwrap();
                let cfg = FsdpConfig {
                    auto_wrap_policy: per_block.then(|| transformer_auto_wrap_policy(["Block"])),
                    ..Default::default()
                };
                let mut f = FullyShardedDataParallel::new(Box::new(m), pg, cfg)?;
                // The FULL state dict, as a user would save it.
                let sd = f.full_state_dict(fsdp::fsdp::FullStateDictConfig::default())?;
                let named = sd
                    .tensors
                    .iter()
                    .map(|(n, t)| Ok((n.clone(), t.to_vec_f32()?)))
                    .collect::<fsdp::Result<Vec<_>>>()?;
                Ok((meta_params, named))
            })
            .unwrap();
            for (rank, (meta, got)) in out.iter().enumerate() {
                assert_eq!(*meta, want.len(), "every parameter starts on meta");
                assert_eq!(
                    bits(got),
                    want,
                    "world {world} per_block {per_block} rank {rank}"
                );
            }
        }
    }
}

#[test]
fn materialize_computes_a_meta_module_like_eager_init_and_keeps_ties() {
    let mut m = on_meta_device(|| GPT::new(gpt_config(), 7)).unwrap();
    materialize(&mut m).unwrap();
    let mut got = Vec::new();
    visit_parameters(&mut m, "", false, &mut |n, p| {
        got.push((n.to_string(), p.data().unwrap().to_vec_f32().unwrap()));
        Ok(())
    })
    .unwrap();
    assert_eq!(bits(&got), bits(&eager()));
    // Two names, one meta tensor: still one tensor after materializing.
    let (mut a, mut b) = on_meta_device(|| {
        let k = InitKey::new(1);
        (
            Linear::new(3, 4, false, &k.child("a")).unwrap(),
            Linear::new(3, 4, false, &k.child("b")).unwrap(),
        )
    });
    b.weight.tie_to(&a.weight).unwrap();
    let mut seq = Sequential::new(vec![
        Box::new(std::mem::replace(
            &mut a,
            Linear::new(1, 1, false, &InitKey::new(0)).unwrap(),
        )),
        Box::new(b),
    ]);
    materialize(&mut seq).unwrap();
    let mut ts: Vec<Tensor> = Vec::new();
    visit_parameters(&mut seq, "", false, &mut |_, p| {
        ts.push(p.data().unwrap().clone());
        Ok(())
    })
    .unwrap();
    assert!(ts[0].same_view(&ts[1]));
}

#[test]
fn per_rank_init_peak_at_world_size_4_is_a_quarter_of_world_size_1() {
    let peak = |world: usize| {
        launch(&LaunchOptions::new(world), |pg: Group| {
            let cfg = fsdp::train::TrainConfig::default();
            let model = on_meta_device(|| GPT::new(cfg.gpt_config(), 1))?;
            let fcfg = FsdpConfig {
                auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
                ..Default::default()
            };
            let f = FullyShardedDataParallel::new(Box::new(model), pg, fcfg)?;
            Ok(f.memory_stats().init_peak_bytes)
        })
        .unwrap()
    };
    let one = peak(1)[0];
    // The whole default GPT in f32 (no padding at world size 1).
    let mut eager = GPT::new(fsdp::train::TrainConfig::default().gpt_config(), 1).unwrap();
    assert_eq!(one, 4 * fsdp::nn::num_parameters(&mut eager));
    for (rank, p) in peak(4).into_iter().enumerate() {
        let ratio = p as f64 / one as f64;
        assert!(
            (0.25..0.2501).contains(&ratio),
            "rank {rank}: {p} / {one} = {ratio}"
        );
    }
    // Eager init holds the whole model on every rank before sharding.
    let eager_peak = launch(&LaunchOptions::new(4), |pg: Group| {
        let model = GPT::new(fsdp::train::TrainConfig::default().gpt_config(), 1)?;
        let f = FullyShardedDataParallel::new(Box::new(model), pg, FsdpConfig::default())?;
        Ok(f.memory_stats().init_peak_bytes)
    })
    .unwrap();
    assert!(
        eager_peak.iter().all(|&p| p > one),
        "{eager_peak:?} vs {one}"
    );
}

/// Root -> [Sequential(Linear, Linear), Linear], built with meta tensors that carry no
/// initializer, so only a param_init_fn can materialize them.
fn blank_meta_model() -> Box<dyn Module> {
    let lin = |i: usize, o: usize| {
        let mut l = Linear::new(i, o, true, &InitKey::new(0)).unwrap();
        l.weight = Parameter::new("weight", Tensor::meta(&[o, i], fsdp::tensor::DType::F32));
        l.bias = Some(Parameter::new(
            "bias",
            Tensor::meta(&[o], fsdp::tensor::DType::F32),
        ));
        l
    };
    Box::new(Sequential::new(vec![
        Box::new(Sequential::new(vec![
            Box::new(lin(4, 4)),
            Box::new(lin(4, 4)),
        ])),
        Box::new(lin(4, 2)),
    ]))
}

#[test]
fn param_init_fn_initializes_each_nested_unit_exactly_once() {
    let out = launch(&LaunchOptions::new(2), |pg: Group| {
        let calls: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let c = calls.clone();
        let init: ParamInitFn = Arc::new(move |m: &mut dyn Module| {
            let mut names = Vec::new();
            visit_parameters(m, "", false, &mut |n, p| {
                if p.data()
                    .map(|d| d.device() == fsdp::backend::Device::Meta)
                    .unwrap_or(false)
                {
                    let shape = p.shape().to_vec();
                    let v: Vec<f32> = (0..p.numel()).map(|i| i as f32 * 0.5).collect();
                    p.set_data(Some(Tensor::from_vec(v, &shape).unwrap()))
                        .unwrap();
                    names.push(n.to_string());
                }
                Ok(())
            })
            .unwrap();
            *c.lock().unwrap().entry(names.join(",")).or_default() += 1;
            Ok(())
        });
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(fsdp::fsdp::AutoWrapPolicy::Custom(Arc::new(
                |m: &dyn Module, _| m.type_name() == "Linear",
            ))),
            param_init_fn: Some(init),
            ..Default::default()
        };
        let mut f = FullyShardedDataParallel::new(blank_meta_model(), pg, cfg)?;
        let calls = calls.lock().unwrap().clone();
        Ok((calls, f.full_parameters()?))
    })
    .unwrap();
    for (calls, params) in out {
        // Three Linear units, each called once on its own module (names are relative to
        // it), materializing its two parameters: 6 parameters, each initialized once. The
        // root and the inner Sequential own no parameters and are not called.
        assert_eq!(calls, HashMap::from([("weight,bias".to_string(), 3)]));
        assert_eq!(params.len(), 6);
        for (name, v) in params {
            let want: Vec<f32> = (0..v.len()).map(|i| i as f32 * 0.5).collect();
            assert_eq!(v, want, "{name}");
        }
    }
}

#[test]
fn a_meta_parameter_without_an_initializer_needs_a_param_init_fn() {
    let err = launch(&LaunchOptions::new(2), |pg: Group| {
        FullyShardedDataParallel::new(blank_meta_model(), pg, FsdpConfig::default()).map(drop)
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("0.0.weight") && err.contains("param_init_fn"),
        "{err}"
    );
}

/// Every strategy, with the hybrid ones split into nodes as the other tests do.
fn fsdp_config(strategy: ShardingStrategy, world: usize) -> FsdpConfig {
    FsdpConfig {
        sharding_strategy: strategy,
        ranks_per_node: strategy
            .is_hybrid()
            .then(|| common::hybrid_ranks_per_node(world)),
        auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
        ..Default::default()
    }
}

#[test]
fn sync_module_states_makes_every_rank_rank_0s_whatever_each_built() {
    // PyTorch's pattern for loading a checkpoint once: rank 0 builds the model with real
    // values, the others on the meta device (here from another seed, so that only rank 0's
    // values can explain the result). And the reverse, and all on meta. Every layout, every
    // strategy, nested units (one per Block): bitwise rank 0's values (seed 7) everywhere.
    let want = bits(&eager());
    #[derive(Clone, Copy, Debug)]
    enum Layout {
        Rank0Eager,
        Rank0Meta,
        AllMeta,
    }
    for world in [2, 4] {
        for strategy in STRATEGIES {
            for layout in [Layout::Rank0Eager, Layout::Rank0Meta, Layout::AllMeta] {
                let out = launch(&LaunchOptions::new(world), |pg: Group| {
                    let r0 = pg.rank() == 0;
                    let model = match (layout, r0) {
                        (Layout::Rank0Eager, true) => GPT::new(gpt_config(), 7)?,
                        (Layout::Rank0Eager, false) => {
                            on_meta_device(|| GPT::new(gpt_config(), 99))?
                        }
                        (Layout::Rank0Meta, true) | (Layout::AllMeta, _) => {
                            on_meta_device(|| GPT::new(gpt_config(), 7))?
                        }
                        (Layout::Rank0Meta, false) => GPT::new(gpt_config(), 99)?,
                    };
                    let cfg = FsdpConfig {
                        sync_module_states: true,
                        ..fsdp_config(strategy, world)
                    };
                    let mut f = FullyShardedDataParallel::new(Box::new(model), pg, cfg)?;
                    f.full_parameters()
                })
                .unwrap_or_else(|e| panic!("world {world} {strategy:?} {layout:?}: {e}"));
                for (rank, got) in out.iter().enumerate() {
                    assert_eq!(
                        bits(got),
                        want,
                        "world {world} {strategy:?} {layout:?} rank {rank}"
                    );
                }
            }
        }
    }
}

/// Root -> [Sequential(Linear(4,4), Linear(4,4)), Linear(4,2)] with blank meta parameters,
/// the two inner Linears wrapped as units; the root owns the last Linear.
fn nested_blank_model_config(strategy: ShardingStrategy, init: ParamInitFn) -> FsdpConfig {
    FsdpConfig {
        sharding_strategy: strategy,
        ranks_per_node: strategy.is_hybrid().then_some(1),
        auto_wrap_policy: Some(fsdp::fsdp::AutoWrapPolicy::Custom(Arc::new(
            |m: &dyn Module, n| m.type_name() == "Linear" && n == 20,
        ))),
        param_init_fn: Some(init),
        ..Default::default()
    }
}

#[test]
fn param_init_fn_never_reaches_into_a_unit_already_wrapped() {
    // A reset_parameters()-style init: it rewrites every parameter it can see, in place
    // when it has values, with values that say which call wrote them. Under NoShard a
    // nested unit's parameters are live views of its FlatParameter, so an init of the root
    // that could see them would overwrite them (and count them twice).
    let mut results = Vec::new();
    for (world, strategy) in [2, 4].into_iter().flat_map(|w| STRATEGIES.map(|s| (w, s))) {
        let out = launch(&LaunchOptions::new(world), |pg: Group| {
            let touched: Arc<Mutex<Vec<usize>>> = Arc::default();
            let t = touched.clone();
            let init: ParamInitFn = Arc::new(move |m: &mut dyn Module| {
                let mut t = t.lock().unwrap();
                let call = t.len();
                let mut n = 0;
                visit_parameters(m, "", false, &mut |_, p| {
                    let v: Vec<f32> = (0..p.numel())
                        .map(|i| (call * 1000) as f32 + i as f32 * 0.5)
                        .collect();
                    let new = Tensor::from_vec(v, p.shape()).unwrap();
                    match p.data() {
                        Ok(d) if d.device() != fsdp::backend::Device::Meta => {
                            d.copy_from(&new).unwrap()
                        }
                        Ok(_) => p.set_data(Some(new)).unwrap(),
                        Err(_) => {}
                    }
                    n += p.numel();
                    Ok(())
                })
                .unwrap();
                t.push(n);
                Ok(())
            });
            let cfg = nested_blank_model_config(strategy, init);
            let mut f = FullyShardedDataParallel::new(blank_meta_model(), pg, cfg)?;
            let touched = touched.lock().unwrap().clone();
            Ok((touched, f.full_parameters()?))
        })
        .unwrap();
        for (rank, (touched, params)) in out.iter().enumerate() {
            // Two nested units of 20 elements, then the root's own 10: 50 in all, once each.
            assert_eq!(
                touched,
                &vec![20, 20, 10],
                "world {world} {strategy:?} rank {rank}"
            );
            assert_eq!(params.len(), 6);
        }
        results.push((strategy, out[0].1.clone()));
    }
    // The same values under every strategy and world size: call k wrote k * 1000 + i / 2.
    for (strategy, params) in &results {
        assert_eq!(bits(params), bits(&results[0].1), "{strategy:?}");
        let by_name: HashMap<&str, &Vec<f32>> =
            params.iter().map(|(n, v)| (n.as_str(), v)).collect();
        assert_eq!(by_name["0.1.bias"][0], 1000.0, "{strategy:?}");
        assert_eq!(by_name["1.weight"][3], 2001.5, "{strategy:?}");
    }
}
