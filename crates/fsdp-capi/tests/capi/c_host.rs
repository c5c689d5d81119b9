//! `examples/mlp.c`, a C host that computes an MLP in plain loops and trains it
//! through the C ABI on 1, 2 and 4 pthreads: after 5 steps its parameters equal the same
//! model trained by `fsdp::nn` under FSDP (same strategy and world size) and trained
//! unsharded on the whole batch; so do its losses. Under bf16 mixed precision (bfloat16
//! parameter views, bfloat16 gradients handed back) it equals `fsdp::nn` under the same
//! `MixedPrecision`. It refuses unknown arguments with its usage line.

use super::common::assert_close;
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    AutoWrapPolicy, FsdpConfig, FullyShardedDataParallel, MixedPrecision, ShardingStrategy,
};
use fsdp::nn::{Context, InitKey, Linear, Module, ReLU, Sequential};
use fsdp::optim::{AdamConfig, AdamW, Optimizer, SgdConfig, SGD};
use fsdp::tensor::Tensor;
use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;

const ROWS: usize = 8;
const STEPS: usize = 5;

/// `data_value` of mlp.c: the same float32 operations, so the same values.
fn data_value(seed: u32, i: u32) -> f32 {
    let mut h = seed.wrapping_mul(2654435761) ^ (i + 1).wrapping_mul(2246822519);
    h ^= h >> 15;
    h = h.wrapping_mul(2246822519);
    h ^= h >> 13;
    h = h.wrapping_mul(3266489917);
    h ^= h >> 16;
    (h % 2001) as f32 / 1000.0 - 1.0
}

/// Rows `lo..hi` of step `s`: inputs `(n, 7)` and targets `(n, 3)`.
fn batch(s: usize, lo: usize, hi: usize) -> (Tensor, Vec<f32>) {
    let x: Vec<f32> = (lo * 7..hi * 7)
        .map(|i| data_value(100 + s as u32, i as u32))
        .collect();
    let t = (lo * 3..hi * 3)
        .map(|i| data_value(200 + s as u32, i as u32))
        .collect();
    (Tensor::from_vec(x, &[hi - lo, 7]).unwrap(), t)
}

/// Linear(7, 5) - ReLU - Linear(5, 3) with `InitKey::new(11)`: what mlp.c declares.
fn model() -> Box<dyn Module> {
    let k = InitKey::new(11);
    Box::new(Sequential::new(vec![
        Box::new(Linear::new(7, 5, true, &k.child("0")).unwrap()),
        Box::new(ReLU::new()),
        Box::new(Linear::new(5, 3, true, &k.child("2")).unwrap()),
    ]))
}

#[derive(Clone, Copy)]
struct Run {
    strategy: ShardingStrategy,
    adamw: bool,
    accum: usize,
    clip: f32,
    bf16: bool,
}

impl Run {
    fn optimizer(&self) -> Box<dyn Optimizer> {
        if self.adamw {
            Box::new(AdamW::new(AdamConfig {
                lr: 0.01,
                ..AdamConfig::adamw()
            }))
        } else {
            Box::new(SGD::new(SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                ..Default::default()
            }))
        }
    }

    fn args(&self) -> Vec<String> {
        let s = match self.strategy {
            ShardingStrategy::ShardGradOp => "shard-grad-op",
            ShardingStrategy::NoShard => "no-shard",
            _ => "full-shard",
        };
        let o = if self.adamw { "adamw" } else { "sgd" };
        [
            "--strategy",
            s,
            "--optim",
            o,
            "--accum",
            &self.accum.to_string(),
            "--clip",
            &self.clip.to_string(),
            "--precision",
            if self.bf16 { "bf16" } else { "f32" },
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    }
}

/// Forward and backward of rows `lo..hi` with d loss / d y = 2 (y - t) / numel * scale
/// (mse over the rows, as mlp.c computes it); returns the sum of squared errors.
fn micro(m: &mut dyn Module, s: usize, lo: usize, hi: usize, scale: f32) -> f32 {
    let (x, t) = batch(s, lo, hi);
    let out = m.forward(&x, &Context::train()).unwrap();
    let y = out.to_vec_f32().unwrap();
    let n = ((hi - lo) * 3) as f32;
    let dy: Vec<f32> = y
        .iter()
        .zip(&t)
        .map(|(y, t)| 2.0 * (y - t) / n * scale)
        .collect();
    let sse = y.iter().zip(&t).map(|(y, t)| (y - t) * (y - t)).sum();
    // The loss gradient in the output's dtype (bf16 under mixed precision, as the
    // gradient of a bf16 output is).
    let dy = Tensor::from_vec(dy, &[hi - lo, 3])
        .unwrap()
        .to_dtype(out.dtype())
        .unwrap();
    m.backward(&dy, &Context::train()).unwrap();
    sse
}

/// The same training through `fsdp::nn` under FSDP at `world` ranks.
fn through_fsdp_nn(run: Run, world: usize) -> Vec<(String, Vec<f32>)> {
    let cfg = FsdpConfig {
        sharding_strategy: run.strategy,
        auto_wrap_policy: Some(AutoWrapPolicy::Custom(Arc::new(|m: &dyn Module, _| {
            m.type_name() == "Linear"
        }))),
        mixed_precision: run
            .bf16
            .then(|| MixedPrecision::uniform(fsdp::tensor::DType::BF16)),
        ..Default::default()
    };
    launch(&LaunchOptions::new(world), |pg| {
        let (lo, hi) = (pg.rank() * ROWS / world, (pg.rank() + 1) * ROWS / world);
        let mut m = FullyShardedDataParallel::new(model(), pg, cfg.clone())?;
        let mut opt = run.optimizer();
        for s in 0..STEPS {
            let n = hi - lo;
            for k in 0..run.accum {
                let (a, b) = (lo + k * n / run.accum, lo + (k + 1) * n / run.accum);
                let scale = 1.0 / run.accum as f32;
                if k + 1 < run.accum {
                    m.no_sync(|m| Ok(micro(m, s, a, b, scale)))?;
                } else {
                    micro(&mut m, s, a, b, scale);
                }
            }
            if run.clip > 0.0 {
                m.clip_grad_norm_(run.clip, 2.0)?;
            }
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        m.full_parameters()
    })
    .unwrap()
    .remove(0)
}

/// The same training without FSDP: one process, the whole batch.
fn unsharded(run: Run) -> (Vec<(String, Vec<f32>)>, Vec<f32>) {
    let mut m = model();
    let mut opt = run.optimizer();
    let mut losses = Vec::new();
    for s in 0..STEPS {
        losses.push(micro(m.as_mut(), s, 0, ROWS, 1.0) / (ROWS * 3) as f32);
        if run.clip > 0.0 {
            let mut total = 0.0f64;
            fsdp::nn::visit_parameters(m.as_mut(), "", false, &mut |_, p| {
                for g in p.grad().unwrap().to_vec_f32().unwrap() {
                    total += (g as f64) * (g as f64);
                }
                Ok(())
            })
            .unwrap();
            let coef = (run.clip / (total.sqrt() as f32 + 1e-6)).min(1.0);
            fsdp::nn::visit_parameters(m.as_mut(), "", false, &mut |_, p| {
                fsdp::ops::scale_(p.grad().unwrap(), coef).unwrap();
                Ok(())
            })
            .unwrap();
        }
        opt.step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        fsdp::nn::zero_grad(m.as_mut());
    }
    (common_values(m.as_mut()), losses)
}

fn common_values(m: &mut dyn Module) -> Vec<(String, Vec<f32>)> {
    super::common::named_values(m)
}

/// mlp.c's output: `(world, name) -> values` and `(world, step) -> loss`.
type Parsed = (
    BTreeMap<(usize, String), Vec<f32>>,
    BTreeMap<(usize, usize), f32>,
);

fn parse(out: &str) -> Parsed {
    let (mut params, mut losses) = (BTreeMap::new(), BTreeMap::new());
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.first() {
            Some(&"param") => {
                let v = f[3..].iter().map(|v| v.parse().unwrap()).collect();
                params.insert((f[1].parse().unwrap(), f[2].to_string()), v);
            }
            Some(&"loss") => {
                losses.insert(
                    (f[1].parse().unwrap(), f[2].parse().unwrap()),
                    f[3].parse().unwrap(),
                );
            }
            _ => panic!("unexpected line from mlp.c: {line}"),
        }
    }
    (params, losses)
}

fn check(run: Run, worlds: &[usize]) {
    let exe = super::compile_c("examples/mlp.c");
    let worlds_arg = worlds
        .iter()
        .map(|w| w.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = super::run(Command::new(&exe).args(run.args()).args([
        "--worlds",
        &worlds_arg,
        "--steps",
        &STEPS.to_string(),
    ]));
    println!("mlp.c {}:\n{out}", run.args().join(" "));
    let (params, losses) = parse(&out);
    let (plain, plain_losses) = unsharded(run);
    for &world in worlds {
        let what = |n: &str| format!("{} world {world} {n}", run.args().join(" "));
        let reference = through_fsdp_nn(run, world);
        assert_eq!(reference.len(), 4);
        for ((name, want), (plain_name, plain_want)) in reference.iter().zip(&plain) {
            assert_eq!(name, plain_name);
            let got = params
                .get(&(world, name.clone()))
                .unwrap_or_else(|| panic!("{}: missing from the C output", what(name)));
            // Plain loops against the GEMM, and another summation order of the ranks'
            // gradients: f32 rounding, relative 1e-6.
            assert_close(&what(name), got, want, 1e-7, 1e-6);
            assert_close(
                &format!("{} (unsharded)", what(name)),
                got,
                plain_want,
                1e-7,
                1e-6,
            );
        }
        let c_losses: Vec<f32> = (0..STEPS).map(|s| losses[&(world, s)]).collect();
        assert_close(&what("losses"), &c_losses, &plain_losses, 1e-7, 1e-6);
        assert!(
            c_losses[STEPS - 1] < c_losses[0],
            "{}: the loss did not fall: {c_losses:?}",
            what("")
        );
    }
}

#[test]
fn a_c_host_trains_an_mlp_like_fsdp_nn_and_like_unsharded_training() {
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ] {
        let run = Run {
            strategy,
            adamw: false,
            accum: 1,
            clip: 0.0,
            bf16: false,
        };
        check(run, &[1, 2, 4]);
    }
}

#[test]
fn a_c_host_with_adamw_no_sync_accumulation_and_clipping() {
    let run = Run {
        strategy: ShardingStrategy::FullShard,
        adamw: true,
        accum: 2,
        clip: 0.5,
        bf16: false,
    };
    check(run, &[1, 4]);
}

/// Under `MixedPrecision(bf16)` (mlp.c reads bfloat16 views, rounds each layer's output,
/// the loss gradient and the input gradient to bfloat16 as a bf16 module does, hands unit
/// "0"'s gradients back as bfloat16) the parameters after 5
/// steps at world size 1 and 2 equal `fsdp::nn`'s bf16 run to 1e-6 relative (the largest
/// `|C - fsdp::nn| / max(|fsdp::nn|, 1e-2)`). Why that tolerance holds although bf16 has
/// 8 significant bits: both sides round the same values at the same points (parameters,
/// layer outputs and gradients, the gradient before its bf16 reduction), a product of two bf16 values
/// is exact in f32, and only the f32 summation order of the loops and the GEMM differs
/// (~1e-7 relative, as in the f32 test); such a difference changes a later bf16 rounding
/// only when a sum lies within it of a rounding boundary, which these fixed inputs do not
/// hit (the runs agree bit for bit). A bf16 rounding flip would show as ~4e-3 (2^-8), so
/// the bound also tells "same roundings" from "different". The f32 run differs from the
/// bf16 one by more than 1e-3: the precision is in effect.
#[test]
fn a_c_host_in_bf16_trains_like_fsdp_nn_in_bf16() {
    let run = Run {
        strategy: ShardingStrategy::FullShard,
        adamw: false,
        accum: 1,
        clip: 0.0,
        bf16: true,
    };
    let worlds = [1, 2];
    let exe = super::compile_c("examples/mlp.c");
    let out = super::run(Command::new(&exe).args(run.args()).args([
        "--worlds",
        "1,2",
        "--steps",
        &STEPS.to_string(),
    ]));
    println!("mlp.c {}:\n{out}", run.args().join(" "));
    let (params, losses) = parse(&out);
    let f32_run = through_fsdp_nn(Run { bf16: false, ..run }, 1);
    for world in worlds {
        let reference = through_fsdp_nn(run, world);
        let mut worst = (0.0f32, String::new());
        let mut effect = 0.0f32;
        for ((name, want), (_, plain)) in reference.iter().zip(&f32_run) {
            let got = &params[&(world, name.clone())];
            for ((g, w), p) in got.iter().zip(want).zip(plain) {
                let d = (g - w).abs() / w.abs().max(1e-2);
                if d > worst.0 {
                    worst = (d, format!("{name}: C {g} fsdp::nn {w}"));
                }
                effect = effect.max((p - w).abs() / w.abs().max(1e-2));
            }
        }
        println!("bf16 world {world}: largest difference {worst:?}; bf16 vs f32 {effect}");
        let c_losses: Vec<f32> = (0..STEPS).map(|s| losses[&(world, s)]).collect();
        assert!(c_losses[STEPS - 1] < c_losses[0], "{c_losses:?}");
        assert!(worst.0 <= 1e-6, "bf16 world {world}: {worst:?}");
        assert!(effect > 1e-3, "bf16 changed nothing: {effect}");
    }
}

/// mlp.c refuses what it does not understand (an unknown argument, even a lone one; a
/// missing value; a value outside its list) with what is wrong and its usage line on
/// stderr, exit status 2 and nothing on stdout, instead of training with defaults.
#[test]
fn mlp_c_refuses_unknown_arguments_with_its_usage() {
    let exe = super::compile_c("examples/mlp.c");
    for (args, what) in [
        (&["--bogus"][..], "mlp: unknown argument: --bogus"),
        (
            &["--steps", "2", "--bogus", "1"],
            "mlp: unknown argument: --bogus",
        ),
        (&["extra"], "mlp: unknown argument: extra"),
        (&["--steps"], "mlp: missing value after: --steps"),
        (
            &["--strategy", "fulll-shard"],
            "mlp: bad value for --strategy: fulll-shard",
        ),
        (&["--worlds", "2,x"], "mlp: bad value for --worlds: 2,x"),
        (&["--steps", "65"], "mlp: bad value for --steps: 65"),
    ] {
        let o = Command::new(&exe).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}\n{err}", o.status);
        assert!(
            err.starts_with(&format!("{what}\nusage: mlp [--strategy ")),
            "{args:?}: {err}"
        );
        assert!(
            o.stdout.is_empty(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    // --help prints the usage on stdout and succeeds.
    let help = super::run(Command::new(&exe).arg("--help"));
    assert!(help.starts_with("usage: mlp [--strategy "), "{help}");
}
