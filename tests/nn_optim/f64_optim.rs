//! Optimizer state of f64 parameters stays f64 (PyTorch keeps `exp_avg`, `exp_avg_sq` and
//! `momentum_buffer` in the parameter's dtype): Adam, AdamW and SGD state dicts round-trip
//! bit for bit, FSDP's full and sharded optimizer state dicts of an f64 model hold f64
//! tensors, and a checkpoint saved at world size 2 reloads the same bits at world size 3.

use fsdp::checkpoint::{load_checkpoint, save_checkpoint};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullStateDictConfig, FullyShardedDataParallel,
    OptimStateDict, StateDict, StateDictConfig, StateDictType,
};
use fsdp::nn::{self, Context, GptConfig, Module, GPT};
use fsdp::ops;
use fsdp::optim::{Adam, AdamConfig, AdamW, Optimizer, ParamGrad, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};
use fsdp::Result;

fn wave(n: usize, k: f64) -> Vec<f64> {
    (0..n)
        .map(|i| (0.7548776662466927 * i as f64 + k).sin() * (1.0 + 1e-10 * i as f64))
        .collect()
}

/// Makes a fresh optimizer.
type Make = Box<dyn Fn() -> Box<dyn Optimizer>>;

fn optimizers() -> Vec<(&'static str, Make)> {
    vec![
        ("Adam", Box::new(|| Box::new(Adam::new(AdamConfig::adam())))),
        (
            "AdamW",
            Box::new(|| Box::new(AdamW::new(AdamConfig::adamw()))),
        ),
        (
            "SGD",
            Box::new(|| {
                Box::new(SGD::new(SgdConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    ..Default::default()
                }))
            }),
        ),
    ]
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn f64_optimizer_state_dicts_round_trip_bit_exact() {
    for (kind, make) in optimizers() {
        let params: Vec<Tensor> = [7, 4]
            .iter()
            .enumerate()
            .map(|(i, &n)| Tensor::from_vec(wave(n, i as f64), &[n]).unwrap())
            .collect();
        let pgs = |s: usize, ps: &[Tensor]| -> Vec<ParamGrad> {
            ps.iter()
                .enumerate()
                .map(|(i, p)| ParamGrad {
                    param: p.clone(),
                    grad: Some(
                        Tensor::from_vec(wave(p.numel(), 3.0 * s as f64 + i as f64), p.shape())
                            .unwrap(),
                    ),
                })
                .collect()
        };
        let mut opt = make();
        for s in 0..3 {
            opt.step(&pgs(s, &params)).unwrap();
        }
        for p in &params {
            assert_eq!(p.dtype(), DType::F64);
        }
        let st = opt.state_dict().unwrap();
        for t in st.tensors.iter().flatten() {
            assert!(!t.buffers_f64.is_empty(), "{kind}: no f64 buffers");
            for ((n, v), (n32, v32)) in t.buffers_f64.iter().zip(&t.buffers) {
                assert_eq!(n, n32);
                // The f32 view is the rounding; the f64 values carry more bits.
                assert!(
                    v.iter().zip(v32).all(|(a, b)| *a as f32 == *b),
                    "{kind} {n}"
                );
                assert!(v.iter().any(|a| f64::from(*a as f32) != *a), "{kind} {n}");
            }
        }
        // Reloaded into a fresh optimizer: the same state dict, and the same next step.
        let mut back = make();
        back.load_state_dict(&st).unwrap();
        assert_eq!(back.state_dict().unwrap(), st, "{kind}");
        let copies: Vec<Tensor> = params.iter().map(|p| p.deep_clone().unwrap()).collect();
        opt.step(&pgs(3, &params)).unwrap();
        back.step(&pgs(3, &copies)).unwrap();
        for (a, b) in params.iter().zip(&copies) {
            assert_eq!(bits(a), bits(b), "{kind}: the step after reloading differs");
        }
        assert_eq!(opt.state_dict().unwrap(), back.state_dict().unwrap());
    }
}

const CFG: GptConfig = GptConfig {
    vocab_size: 11,
    block_size: 4,
    n_layer: 2,
    n_head: 2,
    n_embd: 8,
};

fn gpt(seed: u64) -> Box<dyn Module> {
    let mut m = GPT::new(CFG, seed).unwrap();
    nn::module_to_dtype(&mut m, DType::F64).unwrap();
    Box::new(m)
}

fn fsdp_gpt(seed: u64, pg: fsdp::distributed::Group) -> Result<FullyShardedDataParallel> {
    let cfg = FsdpConfig {
        auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
        ..FsdpConfig::default()
    };
    FullyShardedDataParallel::new(gpt(seed), pg, cfg)
}

/// Every buffer of a full optimizer state dict as `(buffer, parameter, f64 bits)`.
fn osd_bits(osd: &OptimStateDict) -> Vec<(String, String, Vec<u64>)> {
    let mut out = Vec::new();
    for (b, sd) in &osd.buffers {
        let StateDict::Full(f) = sd else {
            panic!("{b}: not a full state dict")
        };
        for (n, t) in &f.tensors {
            assert_eq!(t.dtype(), DType::F64, "{b} {n}");
            out.push((b.clone(), n.clone(), bits(t)));
        }
    }
    out
}

#[test]
fn fsdp_f64_adam_state_is_f64_and_reloads_exactly_at_another_world_size() -> Result<()> {
    for ty in [StateDictType::Sharded, StateDictType::Full] {
        let dir = std::env::temp_dir().join(format!("fsdp-f64-adam-{}-{ty:?}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.clone();
        let saved = launch(&LaunchOptions::new(2), move |pg| {
            let r = pg.rank();
            let mut m = fsdp_gpt(3, pg)?;
            let mut opt = Adam::new(AdamConfig {
                lr: 1e-2,
                ..AdamConfig::adam()
            });
            for s in 0..2 {
                let ids: Vec<i32> = (0..2 * CFG.block_size)
                    .map(|i| ((3 * i + 5 * r + 7 * s) % CFG.vocab_size) as i32)
                    .collect();
                let ids = Tensor::from_vec(ids, &[2, CFG.block_size])?;
                let logits = m.forward(&ids, &Context::train())?;
                let (_, dl) = ops::cross_entropy(&logits, &ids)?;
                m.backward(&dl, &Context::train())?;
                opt.step(&m.optimizer_params())?;
                m.zero_grad();
            }
            // The sharded state dict's pieces are f64 too.
            let sharded = m.optim_state_dict(&opt, StateDictConfig::Sharded)?;
            for (b, sd) in &sharded.buffers {
                let StateDict::Sharded(s) = sd else {
                    panic!("{b}")
                };
                assert!(!s.tensors.is_empty());
                for (n, t) in &s.tensors {
                    for p in &t.pieces {
                        assert_eq!(p.data.dtype(), DType::F64, "{b} {n}");
                    }
                }
            }
            // Loading either kind back reproduces the state bit for bit.
            let full_cfg = StateDictConfig::Full(FullStateDictConfig::default());
            let want = osd_bits(&m.optim_state_dict(&opt, full_cfg)?);
            for osd in [sharded, m.optim_state_dict(&opt, full_cfg)?] {
                let mut other = Adam::new(AdamConfig::adam());
                m.load_optim_state_dict(&mut other, &osd)?;
                assert_eq!(osd_bits(&m.optim_state_dict(&other, full_cfg)?), want);
            }
            save_checkpoint(&d, &mut m, Some(&opt), ty, serde_json::Value::Null)?;
            Ok(want)
        })?;
        let d = dir.clone();
        let loaded = launch(&LaunchOptions::new(3), move |pg| {
            let mut m = fsdp_gpt(9, pg)?;
            let mut opt = Adam::new(AdamConfig::adam());
            load_checkpoint(&d, &mut m, Some(&mut opt))?;
            let full_cfg = StateDictConfig::Full(FullStateDictConfig::default());
            Ok(osd_bits(&m.optim_state_dict(&opt, full_cfg)?))
        })?;
        assert!(!saved[0].is_empty());
        for (r, l) in loaded.iter().enumerate() {
            assert_eq!(l, &saved[0], "{ty:?}: rank {r} at world size 3");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}
