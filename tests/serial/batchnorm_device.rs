//! BatchNorm1d on CUDA (`kernels/batchnorm.cu`) against the CPU: the ops in f32, f64, bf16
//! and f16 (and bf16/f16 with f32 parameters or running stats) bit for bit — forward,
//! running stats, cumulative-average count, backward, evaluation; `Linear -> BatchNorm1d ->
//! ReLU -> Linear` under FSDP on CUDA at world sizes 1 and 2 (each rank its own batch and
//! running stats) against the same FSDP run on the CPU, in f32 and bf16 mixed precision;
//! and that a training step of BatchNorm1d on the device never waits for it or asks the
//! driver for memory (`backend::counters`).
//!
//! Bit for bit on the device: the kernels run the CPU's operations in the CPU's order, and
//! every one is IEEE-rounded (f64 accumulation for f32/f64, f32 with explicit fused
//! multiply-adds for bf16/f16, correctly rounded division and square root), on cuda-emu
//! and on a GPU alike. The FSDP runs differ from the CPU's by the GEMMs' summation order
//! only. Every test ends in `_cuda` and prints "skipping <test> on CUDA: <why>" without a
//! device.

use crate::bn_model;
use crate::common;

use bn_model::{batch, buffers, model, B, LR, OUT, STEPS};
use fsdp::backend::counters::{host_syncs_on_this_thread, Counters};
use fsdp::backend::Device;
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel, MixedPrecision};
use fsdp::nn::{self, loss, BatchNorm1d, Context, Module};
use fsdp::ops::{self, RunningStats, UpdateFactor};
use fsdp::optim::Optimizer;
use fsdp::tensor::{DType, Tensor};
use fsdp::Result;

const CUDA0: Device = Device::Cuda(0);

/// Whether `test` can run (printing why not).
fn gpu(test: &str) -> bool {
    match fsdp::backend::cuda::detect() {
        Ok(d) if !d.is_empty() => true,
        Ok(_) => {
            eprintln!("skipping {test} on CUDA: no CUDA device");
            false
        }
        Err(e) => {
            eprintln!("skipping {test} on CUDA: {e}");
            false
        }
    }
}

/// `v` as a `dtype` tensor of `shape` on `dev`.
fn on(v: Vec<f32>, shape: &[usize], dtype: DType, dev: Device) -> Tensor {
    let t = Tensor::from_vec(v, shape).unwrap();
    let t = if dtype == DType::F64 {
        let v: Vec<f64> = t.to_vec_f64().unwrap();
        Tensor::from_vec(v, shape).unwrap()
    } else {
        t.to_dtype(dtype).unwrap()
    };
    t.to_device(dev).unwrap()
}

/// One op-level case: the input's, parameters' and running stats' dtypes, the shape, and
/// whether it has an affine weight and bias and a momentum (else a cumulative average).
#[derive(Debug, Clone, Copy)]
struct Case {
    x: DType,
    param: DType,
    running: DType,
    shape: &'static [usize],
    affine: bool,
    momentum: bool,
}

/// Every value `case` produces on `dev`, as `(name, f64 bit patterns)`: a training forward
/// and backward (into non-zero gradients), then an evaluation forward and backward.
fn run_case(case: Case, dev: Device) -> Result<Vec<(String, Vec<u64>)>> {
    let c = case.shape[1];
    let n: usize = case.shape.iter().product();
    let seed = (n * 7 + c) as u64;
    let x = on(
        common::values(seed, n)
            .iter()
            .enumerate()
            .map(|(i, v)| 2.0 * v + 0.3 * (i % c) as f32)
            .collect(),
        case.shape,
        case.x,
        dev,
    );
    let dy = on(common::values(seed + 1, n), case.shape, case.x, dev);
    let chan = |s: u64, scale: f32, off: f32, d: DType| {
        let v = common::values(s, c)
            .iter()
            .map(|v| off + scale * v)
            .collect();
        on(v, &[c], d, dev)
    };
    let (w, b) = (
        chan(seed + 2, 0.3, 1.0, case.param),
        chan(seed + 3, 0.2, 0.0, case.param),
    );
    let (rm, rv) = (
        chan(seed + 4, 0.2, 0.0, case.running),
        chan(seed + 5, 0.3, 1.0, case.running),
    );
    let (dw, db) = (
        chan(seed + 6, 0.1, 0.0, case.param),
        chan(seed + 7, 0.1, 0.0, case.param),
    );
    let count = Tensor::from_vec(vec![2i64], &[])?.to_device(dev)?;
    let (wo, bo) = if case.affine {
        (Some(&w), Some(&b))
    } else {
        (None, None)
    };
    let (dwo, dbo) = if case.affine {
        (Some(&dw), Some(&db))
    } else {
        (None, None)
    };
    let mut out: Vec<(String, Tensor)> = Vec::new();
    for train in [true, false] {
        let factor = if !train {
            UpdateFactor::Momentum(0.0)
        } else if case.momentum {
            UpdateFactor::Momentum(0.1)
        } else {
            ops::batch_norm_count_(&count)?;
            UpdateFactor::CumulativeAverage(&count)
        };
        let running = RunningStats {
            mean: &rm,
            var: &rv,
            factor,
        };
        let (y, saved) = ops::batch_norm(&x, wo, bo, Some(running), train, 1e-5)?;
        let dx = ops::batch_norm_backward(&dy, &saved, wo, dwo, dbo)?;
        let mode = if train { "train" } else { "eval" };
        for (name, t) in [
            ("y", &y),
            ("dx", &dx),
            ("running_mean", &rm),
            ("running_var", &rv),
            ("dw", &dw),
            ("db", &db),
        ] {
            assert_eq!(
                t.device(),
                dev,
                "{case:?} {mode} {name}: on the wrong device"
            );
            out.push((format!("{mode} {name}"), t.clone()));
        }
    }
    // Also a training forward without running stats (batch statistics only).
    let (y, _) = ops::batch_norm(&x, wo, bo, None, true, 1e-5)?;
    out.push(("no running stats y".into(), y));
    out.push(("count".into(), count.clone()));
    out.into_iter()
        .map(|(name, t)| {
            let v = t.to_vec_f64()?;
            Ok((name, v.iter().map(|x| x.to_bits()).collect()))
        })
        .collect()
}

#[test]
fn batch_norm_ops_match_the_cpu_bit_for_bit_cuda() {
    let _serial = crate::serial();
    if !gpu("batch_norm_ops_match_the_cpu_bit_for_bit_cuda") {
        return;
    }
    use DType::{BF16, F16, F32, F64};
    let mut cases = Vec::new();
    // (N, C); (N, C, L) with L past PyTorch's 16-value blocks (bf16/f16); a prime C.
    for shape in [&[7usize, 5][..], &[4, 3, 37], &[2, 2, 16]] {
        for (x, param, running) in [
            (F32, F32, F32),
            (F64, F64, F64),
            (BF16, BF16, BF16),
            (F16, F16, F16),
            // FSDP MixedPrecision: low-precision parameters, f32 buffer storage.
            (BF16, BF16, F32),
            (F16, F16, F32),
            // A "mixed type" call: f32 parameters and running stats.
            (BF16, F32, F32),
            (F16, F32, F32),
        ] {
            for (affine, momentum) in [(true, true), (false, false)] {
                cases.push(Case {
                    x,
                    param,
                    running,
                    shape,
                    affine,
                    momentum,
                });
            }
        }
    }
    for case in cases {
        let (cpu, dev) = (
            run_case(case, Device::Cpu).unwrap(),
            run_case(case, CUDA0).unwrap(),
        );
        for ((name, want), (_, got)) in cpu.iter().zip(&dev) {
            let bad = want.iter().zip(got).filter(|(a, b)| a != b).count();
            assert_eq!(
                bad,
                0,
                "{case:?} {name}: {bad} of {} values differ from the CPU's\n got {:?}\nwant {:?}",
                want.len(),
                got.iter().map(|b| f64::from_bits(*b)).collect::<Vec<_>>(),
                want.iter().map(|b| f64::from_bits(*b)).collect::<Vec<_>>()
            );
        }
    }
}

/// `Linear -> BatchNorm1d -> ReLU -> Linear` under FSDP at `world` on `dev`, `STEPS` SGD
/// steps on each rank's batches: per rank the full parameters, the rank's buffers and its
/// losses.
type RankRun = (Vec<(String, Vec<f32>)>, Vec<(String, Vec<f64>)>, Vec<f32>);

fn fsdp_run(world: usize, dev: Device, mp: Option<MixedPrecision>) -> Vec<RankRun> {
    launch(&LaunchOptions::new(world), move |pg| {
        let r = pg.rank();
        let cfg = FsdpConfig {
            device_id: Some(dev),
            mixed_precision: mp,
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(model(), pg, cfg)?;
        let mut opt = common::sgd(LR);
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let (x, t) = batch(r, s);
            let y = m.forward(&x.to_device(dev)?, &Context::train())?;
            let (l, dy) = loss::mse_loss(&y, &t.to_device(dev)?.to_dtype(y.dtype())?)?;
            m.backward(&dy, &Context::train())?;
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
            losses.push(l);
        }
        Ok((m.full_parameters()?, buffers(&mut m), losses))
    })
    .unwrap()
}

#[test]
fn fsdp_batchnorm_on_cuda_matches_the_cpu_run_cuda() {
    let _serial = crate::serial();
    if !gpu("fsdp_batchnorm_on_cuda_matches_the_cpu_run_cuda") {
        return;
    }
    // f32: the GEMMs' order apart, the same arithmetic; bf16: the GEMMs' bf16 roundings
    // may fall differently, a bf16 ulp or so.
    for (mp, tol) in [
        (None, 1e-5f32),
        (Some(MixedPrecision::uniform(DType::BF16)), 3e-2),
    ] {
        for world in [1, 2] {
            let (cpu, dev) = (fsdp_run(world, Device::Cpu, mp), fsdp_run(world, CUDA0, mp));
            for (r, (c, g)) in cpu.iter().zip(&dev).enumerate() {
                let at = format!("world {world}, {mp:?}, rank {r}");
                for ((n, want), (gn, got)) in c.0.iter().zip(&g.0) {
                    assert_eq!(n, gn);
                    common::assert_close(&format!("{at}: {n}"), got, want, tol, tol);
                }
                assert_eq!(g.1.len(), 3, "{at}: buffers {:?}", g.1);
                for ((n, want), (_, got)) in c.1.iter().zip(&g.1) {
                    let f = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
                    common::assert_close(&format!("{at}: {n}"), &f(got), &f(want), tol, tol);
                }
                common::assert_close(&format!("{at}: losses"), &g.2, &c.2, tol, tol);
            }
            if world == 2 {
                // Each rank normalized its own batch: its own running stats.
                assert_ne!(
                    dev[0].1[0].1, dev[1].1[0].1,
                    "world 2: ranks' running means"
                );
            }
        }
    }
}

#[test]
fn batchnorm_training_on_the_device_never_waits_for_it_cuda() {
    let _serial = crate::serial();
    if !gpu("batchnorm_training_on_the_device_never_waits_for_it_cuda") {
        return;
    }
    // FSDP_CUDA_NO_CACHING=1 gives every tensor its own driver allocation.
    let caching = std::env::var("FSDP_CUDA_NO_CACHING").map_or(true, |v| v != "1");
    // BatchNorm1d alone (a cumulative average: the count is read on the device), f32 and
    // bf16; then the FSDP model at world size 1, f32 and bf16 mixed precision. dy is
    // given, so nothing is read back (a loss value would be).
    for dtype in [DType::F32, DType::BF16] {
        let mut bn = BatchNorm1d::with_options(6, 1e-5, None, true, true).unwrap();
        bn.to_dtype(dtype).unwrap();
        nn::module_to_device(&mut bn, CUDA0).unwrap();
        let x = on(common::values(1, 5 * 6 * 3), &[5, 6, 3], dtype, CUDA0);
        let dy = on(common::values(2, 5 * 6 * 3), &[5, 6, 3], dtype, CUDA0);
        for step in 0..3 {
            let (c0, s0) = (Counters::now(), host_syncs_on_this_thread());
            bn.forward(&x, &Context::train()).unwrap();
            bn.backward(&dy, &Context::train()).unwrap();
            let (d, syncs) = (Counters::now().since(&c0), host_syncs_on_this_thread() - s0);
            assert_eq!(syncs, 0, "BatchNorm1d {dtype} step {step}: host syncs");
            if step > 0 && caching {
                assert_eq!(d.device_allocs, 0, "BatchNorm1d {dtype} step {step}: {d:?}");
            }
        }
        assert_eq!(bn.num_batches_tracked().unwrap(), Some(3));
    }
    for mp in [None, Some(MixedPrecision::uniform(DType::BF16))] {
        let counts = launch(&LaunchOptions::new(1), move |pg| {
            let cfg = FsdpConfig {
                device_id: Some(CUDA0),
                mixed_precision: mp,
                ..FsdpConfig::default()
            };
            let mut m = FullyShardedDataParallel::new(model(), pg, cfg)?;
            let mut opt = common::sgd(LR);
            let (x, _) = batch(0, 0);
            let x = x.to_device(CUDA0)?;
            let mut counts = Vec::new();
            let mut dy: Option<Tensor> = None;
            for _ in 0..4 {
                let (c0, s0) = (Counters::now(), host_syncs_on_this_thread());
                let y = m.forward(&x, &Context::train())?;
                // The first step copies dy to the device (a host copy); the others reuse it.
                let g = match &dy {
                    Some(g) => g.clone(),
                    None => Tensor::from_vec(vec![0.5f32; B * OUT], &[B, OUT])?
                        .to_dtype(y.dtype())?
                        .to_device(CUDA0)?,
                };
                dy = Some(g.clone());
                m.backward(&g, &Context::train())?;
                opt.step(&m.optimizer_params())?;
                m.zero_grad();
                counts.push((Counters::now().since(&c0), host_syncs_on_this_thread() - s0));
            }
            Ok(counts)
        })
        .unwrap();
        for (step, (d, syncs)) in counts[0].iter().enumerate().skip(1) {
            assert_eq!(*syncs, 0, "FSDP {mp:?} step {step}: host syncs");
            if caching {
                assert_eq!(
                    d.device_allocs + d.fsdp_buffer_allocs,
                    0,
                    "FSDP {mp:?} step {step}: {d:?}"
                );
            }
        }
    }
}
