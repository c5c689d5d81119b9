//! Deferred initialization: models built on the meta device, materialized shard by shard
//! by FSDP (or by a param_init_fn), identical for every world size and to eager init.

mod common;

use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel, ParamInitFn};
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
    let mut out = Vec::new();
    visit_parameters(&mut m, "", false, &mut |n, p| {
        out.push((n.to_string(), p.data().unwrap().to_vec_f32().unwrap()))
    });
    out
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
                        usize::from(p.data().unwrap().device() == fsdp::backend::Device::Meta)
                });
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
        got.push((n.to_string(), p.data().unwrap().to_vec_f32().unwrap()))
    });
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
        ts.push(p.data().unwrap().clone())
    });
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
            });
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
