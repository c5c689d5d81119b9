//! f64 on each device, as f32 (PyTorch computes float64 tensors in float64, and FSDP takes
//! float64 parameters): matrix products of float64 tensors in f64 (host loops on the CPU,
//! cuBLAS with `CUBLAS_COMPUTE_64F` on CUDA) against an f64 reference; every f64 op of
//! the nn layers, FSDP's flat buffers and the optimizers on CUDA (the `_f64` kernels)
//! against the CPU's f64 ops; the f64 GPT trained with FSDP on CUDA (1 and 2 thread ranks,
//! FullShard and ShardGradOp, Adam and AdamW) against the same training on the CPU to
//! 1e-12; `fsdp train --mixed-precision f64` on CUDA against the CPU, with no host wait
//! and no allocation on a quiet step; mixed precision over f64 parameters refused on
//! every device.

use crate::common;
use crate::device;
use crate::device_test;
use crate::f64_model;

use fsdp::backend::Device;
use fsdp::ops::{self, HeadDims, MatmulDims, Pointwise, Transpose};
use fsdp::tensor::{DType, Tensor};

/// `n` f64 values with bits beyond f32's.
fn wave(n: usize, k: f64) -> Vec<f64> {
    (0..n)
        .map(|i| (0.7548776662466927 * i as f64 + k).sin() * (1.0 + 1e-10 * i as f64))
        .collect()
}

fn on(v: Vec<f64>, shape: &[usize], dev: Device) -> Tensor {
    Tensor::from_vec(v, shape).unwrap().to_device(dev).unwrap()
}

/// `op(a) @ op(b)` per block, summed in f64 in `k` order.
fn reference(a: &[f64], b: &[f64], m: usize, k: usize, n: usize, t: Transpose) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|p| {
                    let x = if t.a { a[p * m + i] } else { a[i * k + p] };
                    let y = if t.b { b[j * k + p] } else { b[p * n + j] };
                    x * y
                })
                .fold(0.0, |s, v| s + v);
        }
    }
    out
}

device_test!(f64_matmul_computes_in_f64, |dev| {
    let _serial = crate::serial();
    let layouts = [
        Transpose::NN,
        Transpose::NT,
        Transpose::TN,
        Transpose { a: true, b: true },
    ];
    for (m, k, n, batch) in [
        (1usize, 1usize, 1usize, 1usize),
        (7, 13, 5, 1),
        (3, 17, 11, 4),
    ] {
        for t in layouts {
            let (a, b) = (wave(batch * m * k, 0.1), wave(batch * k * n, 1.3));
            let c0 = wave(batch * m * n, 2.9);
            let d = MatmulDims::new(m, k, n, t);
            let (ad, bd) = (
                on(a.clone(), &[batch, m * k], dev),
                on(b.clone(), &[batch, k * n], dev),
            );
            for accumulate in [false, true] {
                let out = on(c0.clone(), &[batch, m, n], dev);
                ops::matmul_batched(&out, &ad, &bd, d, batch, accumulate)?;
                assert_eq!(out.device(), dev);
                let got = out.to_vec_f64()?;
                for i in 0..batch {
                    let want = reference(
                        &a[i * m * k..(i + 1) * m * k],
                        &b[i * k * n..(i + 1) * k * n],
                        m,
                        k,
                        n,
                        t,
                    );
                    for (j, w) in want.iter().enumerate() {
                        let at = i * m * n + j;
                        let w = if accumulate { c0[at] + w } else { *w };
                        let g = got[at];
                        // The CPU (the gemm crate's fused multiply-adds) and cuBLAS sum in
                        // their own orders: equal to f64 rounding (f32 compute would miss
                        // by 1e-8).
                        let tol = 1e-14 * k as f64;
                        assert!(
                            (g - w).abs() <= tol * (1.0 + w.abs()),
                            "{m}x{k}x{n} x{batch} {t:?} acc {accumulate} on {dev} at {at}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
    Ok(())
});

/// `got` (an f64 tensor computed on `dev`) against `want` (the CPU's f64 op): bitwise on the
/// CPU; on CUDA within `rel` of the largest `|want|` (the kernels reduce rows and columns
/// in another order than the host loops, and a GPU's erf/exp are not the host's libm).
/// Returns the largest difference relative to that scale.
fn close(what: &str, dev: Device, got: &Tensor, want: &Tensor, rel: f64) -> f64 {
    assert_eq!(
        (got.dtype(), got.device(), got.shape()),
        (DType::F64, dev, want.shape()),
        "{what}"
    );
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    if dev == Device::Cpu {
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&g), bits(&w), "{what}: not bitwise equal on the CPU");
        return 0.0;
    }
    let scale = w.iter().fold(f64::MIN_POSITIVE, |m, v| m.max(v.abs()));
    let worst = g
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs() / scale)
        .fold(0.0, f64::max);
    assert!(
        worst <= rel,
        "{what} on {dev}: max difference {worst:e} of |want| {scale:e}"
    );
    worst
}

/// `f` run on `dev` (what was got) and on the CPU (what is wanted).
fn both<T>(dev: Device, f: impl Fn(Device) -> T) -> (T, T) {
    (f(dev), f(Device::Cpu))
}

/// Relative tolerance of an elementwise f64 kernel (erf/exp in double) and of a reduction.
const ELEM: f64 = 1e-15;
const REDUCE: f64 = 1e-14;

device_test!(f64_layer_ops_match_the_cpu, |dev| {
    let _serial = crate::serial();
    let mut worst = 0.0f64;
    let mut check = |what: &str, got: &Tensor, want: &Tensor, rel: f64| {
        worst = worst.max(close(what, dev, got, want, rel));
    };
    // Pointwise, over sizes that leave vector tails.
    let x = |d| {
        on(
            wave(7 * 37, 0.3).iter().map(|v| 3.0 * v).collect(),
            &[7, 37],
            d,
        )
    };
    let dy = |d| on(wave(7 * 37, 1.7), &[7, 37], d);
    for f in [Pointwise::Gelu, Pointwise::Relu] {
        let (g, w) = both(dev, |d| ops::pointwise(f, &x(d)).unwrap());
        check(f.name(), &g, &w, ELEM);
        let (g, w) = both(dev, |d| ops::pointwise_backward(f, &x(d), &dy(d)).unwrap());
        check(&format!("{} backward", f.name()), &g, &w, ELEM);
    }
    // Linear (cuBLAS f64 + bias_add_f64) and the bias gradient (column sums).
    let (g, w) = both(dev, |d| {
        let (xx, wt, b) = (
            x(d),
            on(wave(5 * 37, 2.1), &[5, 37], d),
            on(wave(5, 0.9), &[5], d),
        );
        ops::linear(&xx, &wt, Some(&b)).unwrap()
    });
    check("linear", &g, &w, REDUCE);
    let (g, w) = both(dev, |d| {
        let db = on(wave(37, 0.5), &[37], d);
        ops::bias_grad(&dy(d), &db).unwrap();
        db
    });
    check("bias_grad", &g, &w, REDUCE);
    // LayerNorm forward (y, xhat, rstd) and backward (dx, dw, db += ...).
    let (g, w) = both(dev, |d| {
        let (wt, b) = (on(wave(37, 0.2), &[37], d), on(wave(37, 1.1), &[37], d));
        let (y, saved) = ops::layer_norm(&x(d), &wt, &b, 1e-5).unwrap();
        let (dw, db) = (on(wave(37, 0.4), &[37], d), on(wave(37, 0.6), &[37], d));
        let dx = ops::layer_norm_backward(&dy(d), &saved, &wt, Some(&dw), Some(&db)).unwrap();
        [y, saved.xhat, saved.rstd, dx, dw, db]
    });
    for (i, what) in ["y", "xhat", "rstd", "dx", "dw", "db"].iter().enumerate() {
        check(&format!("layer_norm {what}"), &g[i], &w[i], REDUCE);
    }
    // Attention's permutes and causal softmax: B 2, H 3, T 5, hd 4.
    let hd = HeadDims {
        b: 2,
        t: 5,
        h: 3,
        hd: 4,
    };
    let (g, w) = both(dev, |d| {
        let qkv = on(wave(3 * hd.numel(), 0.8), &[2, 5, 36], d);
        let [q, k, v] = ops::split_qkv(&qkv, hd).unwrap();
        let back = ops::merge_qkv(&q, &k, &v, hd).unwrap();
        let merged = ops::merge_heads(&q, hd).unwrap();
        let split = ops::split_heads(&merged, hd).unwrap();
        [q, k, v, back, merged, split]
    });
    for (i, what) in ["q", "k", "v", "merge_qkv", "merge_heads", "split_heads"]
        .iter()
        .enumerate()
    {
        check(what, &g[i], &w[i], 0.0);
    }
    let (g, w) = both(dev, |d| {
        let s = on(
            wave(30 * 5, 0.1).iter().map(|v| 4.0 * v).collect(),
            &[30, 5],
            d,
        );
        let p = ops::softmax_causal(&s, 5, 0.35).unwrap();
        let dp = on(wave(30 * 5, 2.5), &[30, 5], d);
        ops::softmax_causal_backward_(&p, &dp, 5, 0.35).unwrap();
        [p, dp]
    });
    check("softmax_causal", &g[0], &w[0], REDUCE);
    check("softmax_causal backward", &g[1], &w[1], REDUCE);
    // Embedding with repeated ids (atomic adds on CUDA).
    let ids = |d| {
        Tensor::from_vec((0..12).map(|i| i * 5 % 7).collect::<Vec<i32>>(), &[3, 4])
            .unwrap()
            .to_device(d)
            .unwrap()
    };
    let (g, w) = both(dev, |d| {
        let table = on(wave(7 * 6, 0.7), &[7, 6], d);
        let out = ops::embedding(&table, &ids(d)).unwrap();
        let grad = on(wave(7 * 6, 1.9), &[7, 6], d);
        ops::embedding_backward(&ids(d), &on(wave(12 * 6, 3.3), &[3, 4, 6], d), &grad).unwrap();
        [out, grad]
    });
    check("embedding", &g[0], &w[0], 0.0);
    check("embedding backward", &g[1], &w[1], REDUCE);
    // Cross-entropy: the f64 loss, its f32 rounding, and the gradient.
    let targets = |d| {
        Tensor::from_vec((0..9).map(|i| i * 4 % 11).collect::<Vec<i32>>(), &[9])
            .unwrap()
            .to_device(d)
            .unwrap()
    };
    let logits = |d| {
        on(
            wave(9 * 11, 0.6).iter().map(|v| 5.0 * v).collect(),
            &[9, 11],
            d,
        )
    };
    let ((lg, gg), (lw, gw)) = both(dev, |d| {
        ops::cross_entropy_f64(&logits(d), &targets(d)).unwrap()
    });
    check("cross_entropy gradient", &gg, &gw, REDUCE);
    assert!(
        (lg - lw).abs() <= REDUCE * lw.abs(),
        "cross_entropy_f64: {lg} vs {lw}"
    );
    let (l32, g32) = ops::cross_entropy(&logits(dev), &targets(dev))?;
    assert_eq!(
        l32, lg as f32,
        "the f32 loss of f64 logits rounds the f64 one"
    );
    check("cross_entropy (f32 loss) gradient", &g32, &gw, REDUCE);
    println!("f64 layer ops on {dev}: worst difference {worst:e} of the largest |value|");
    Ok(())
});

device_test!(f64_losses_match_the_cpu, |dev| {
    let _serial = crate::serial();
    // MSE and sum of f64 tensors on any device: the f64 loss as the CPU computes it, the
    // gradient on the input's device, bit for bit.
    let (g, w) = both(dev, |d| {
        let (pred, target) = (
            on(wave(5 * 9, 0.4), &[5, 9], d),
            on(wave(45, 1.3), &[5, 9], d),
        );
        let (mse, dmse) = ops::mse_loss(&pred, &target).unwrap();
        let (sum, dsum) = ops::sum_loss(&pred).unwrap();
        ((mse, sum), [dmse, dsum])
    });
    assert_eq!(g.0, w.0, "mse and sum losses on {dev}");
    assert!(
        w.0 .0 > 0.1 && w.0 .1.abs() > 1e-3,
        "degenerate losses {:?}",
        w.0
    );
    close("mse_loss gradient", dev, &g.1[0], &w.1[0], 0.0);
    close("sum_loss gradient", dev, &g.1[1], &w.1[1], 0.0);
    Ok(())
});

device_test!(f64_flat_and_elementwise_ops_match_the_cpu, |dev| {
    let _serial = crate::serial();
    let n = 1003;
    let mut worst = 0.0f64;
    let mut check = |what: &str, got: &Tensor, want: &Tensor, rel: f64| {
        worst = worst.max(close(what, dev, got, want, rel));
    };
    // FSDP's pack and unpack of an f64 gradient: a divide factor (1 / 1.5) divides in f64,
    // another scale multiplies; in place and into another tensor.
    for scale in [1.0f32 / 1.5, 0.3] {
        let (g, w) = both(dev, |d| {
            let (x, out) = (on(wave(n, 0.2), &[n], d), on(vec![0.0; n], &[n], d));
            ops::flat::pack_grad(&x, &out, scale).unwrap();
            ops::flat::unpack_grad(&x, &x, scale).unwrap();
            [out, x]
        });
        check(&format!("pack_grad x {scale}"), &g[0], &w[0], 0.0);
        check(
            &format!("unpack_grad x {scale} in place"),
            &g[1],
            &w[1],
            0.0,
        );
    }
    let (g, w) = both(dev, |d| {
        let (a, b) = (on(wave(n, 0.2), &[n], d), on(wave(n, 1.2), &[n], d));
        ops::add_(&a, &b).unwrap();
        ops::scale_(&b, 0.7).unwrap();
        let f = on(wave(n, 2.2), &[n], d);
        ops::fill_(&f, 0.1).unwrap();
        // f64 -> f32 -> f64 on the device (the cast kernels), exact on the way back.
        let r = a
            .to_dtype(DType::F32)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        [a, b, f, r]
    });
    for (i, what) in ["add_", "scale_", "fill_", "f32 round trip"]
        .iter()
        .enumerate()
    {
        check(what, &g[i], &w[i], 0.0);
    }
    let x = on(wave(n, 0.9), &[n], dev);
    let want: f64 = wave(n, 0.9).iter().map(|v| v * v).sum();
    let got = ops::sum_squares(&x)?;
    assert!(
        (got - want).abs() <= REDUCE * want,
        "sum_squares: {got} vs {want}"
    );
    println!("f64 flat ops on {dev}: worst difference {worst:e} of the largest |value|");
    Ok(())
});

device_test!(f64_optimizer_steps_match_the_cpu_bitwise, |dev| {
    let _serial = crate::serial();
    use fsdp::optim::{Adam, AdamConfig, AdamW, Optimizer, ParamGrad, SgdConfig, SGD};
    // Three steps over two tensors: the f64 updates (no transcendental function, IEEE
    // division and root) give the CPU's bits on every device.
    type Make = Box<dyn Fn() -> Box<dyn Optimizer>>;
    let opts: Vec<(&str, Make)> = vec![
        (
            "SGD",
            Box::new(|| {
                Box::new(SGD::new(SgdConfig {
                    lr: 0.05,
                    momentum: 0.9,
                    dampening: 0.1,
                    weight_decay: 0.01,
                    nesterov: false,
                }))
            }),
        ),
        (
            "SGD nesterov",
            Box::new(|| {
                Box::new(SGD::new(SgdConfig {
                    lr: 0.05,
                    momentum: 0.9,
                    dampening: 0.0,
                    weight_decay: 0.0,
                    nesterov: true,
                }))
            }),
        ),
        (
            "Adam",
            Box::new(|| {
                Box::new(Adam::new(AdamConfig {
                    weight_decay: 0.01,
                    ..AdamConfig::adam()
                }))
            }),
        ),
        (
            "AdamW",
            Box::new(|| Box::new(AdamW::new(AdamConfig::adamw()))),
        ),
    ];
    for (name, make) in &opts {
        let (g, w) = both(dev, |d| {
            let ps = [on(wave(300, 0.1), &[300], d), on(wave(7, 0.5), &[7], d)];
            let mut o = make();
            for s in 0..3 {
                let pgs: Vec<ParamGrad> = ps
                    .iter()
                    .enumerate()
                    .map(|(i, p)| ParamGrad {
                        param: p.clone(),
                        grad: Some(on(wave(p.numel(), 0.3 * (i + s) as f64), &[p.numel()], d)),
                    })
                    .collect();
                o.step(&pgs).unwrap();
            }
            ps
        });
        for i in 0..2 {
            close(&format!("{name} param {i}"), dev, &g[i], &w[i], 0.0);
        }
    }
    Ok(())
});

device_test!(
    f64_fsdp_refuses_mixed_precision_and_wraps_otherwise,
    |dev| {
        let _serial = crate::serial();
        use fsdp::distributed::{launch, LaunchOptions};
        use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel, MixedPrecision};
        use fsdp::nn::{self, InitKey, Linear};
        for mp in [None, Some(MixedPrecision::uniform(DType::BF16))] {
            let r = launch(&LaunchOptions::new(1), move |pg| {
                let mut m = Linear::new(3, 2, true, &InitKey::new(1))?;
                nn::module_to_dtype(&mut m, DType::F64)?;
                let cfg = FsdpConfig {
                    device_id: Some(dev),
                    mixed_precision: mp,
                    ..FsdpConfig::default()
                };
                Ok(FullyShardedDataParallel::new(Box::new(m), pg, cfg)
                    .map(|m| m.flat_param().device())
                    .map_err(|e| e.to_string()))
            })?;
            match (mp, &r[0]) {
                (None, Ok(d)) => assert_eq!(*d, dev),
                (Some(_), Err(e)) => assert!(e.contains("f64"), "{e}"),
                (_, r) => panic!("mixed precision {mp:?} over f64 parameters on {dev}: {r:?}"),
            }
        }
        Ok(())
    }
);

/// The GPUs of this machine, or `None` after printing why `test` is skipped.
fn gpus(test: &str) -> Option<usize> {
    match device::cuda_device() {
        Ok(_) => Some(fsdp::backend::cuda::detect().map_or(1, |d| d.len())),
        Err(why) => {
            eprintln!("skipping {test} on CUDA: {why}");
            None
        }
    }
}

#[test]
fn f64_fsdp_gpt_on_cuda_equals_the_cpu_cuda() {
    let _serial = crate::serial();
    use f64_model::{fsdp_train, Run};
    use fsdp::fsdp::ShardingStrategy;
    let Some(n) = gpus("f64_fsdp_gpt_on_cuda_equals_the_cpu") else {
        return;
    };
    let (mut loss_worst, mut param_worst, mut grad_worst) = (0.0f64, 0.0f64, 0.0f64);
    let mut cases = Vec::new();
    for world in [1, 2] {
        for strategy in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
            cases.push((world, strategy, true, false));
        }
    }
    cases.push((2, ShardingStrategy::FullShard, false, true));
    cases.push((1, ShardingStrategy::NoShard, true, false));
    for (world, strategy, nested, decoupled) in cases {
        let run = |gpus| {
            fsdp_train(Run {
                world,
                strategy,
                nested,
                decoupled,
                gpus,
            })
        };
        let (got, want) = (run(Some(n)), run(None));
        let at = format!("world {world}, {strategy:?}, nested {nested}, AdamW {decoupled}");
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            for (s, (a, b)) in g.losses.iter().zip(&w.losses).enumerate() {
                let e = (a - b).abs() / b.abs();
                assert!(
                    e <= 1e-12,
                    "{at}, rank {r}, step {s}: loss {a} vs {b} ({e:e})"
                );
                loss_worst = loss_worst.max(e);
            }
            assert_eq!(g.losses.len(), f64_model::STEPS);
            // Relative to each tensor's largest |value|: a parameter whose gradient is 0
            // but for rounding (the key bias) steps by Adam's rounding-level noise.
            for ((gn, gv), (wn, wv)) in g.params.iter().zip(&w.params) {
                assert_eq!(gn, wn, "{at}");
                let scale = wv.iter().fold(1e-300f64, |m, v| m.max(v.abs()));
                for (a, b) in gv.iter().zip(wv) {
                    let e = (a - b).abs() / scale;
                    assert!(e <= 1e-12, "{at}, rank {r}: {gn}: {a} vs {b} ({e:e})");
                    param_worst = param_worst.max(e);
                }
            }
            assert_eq!(g.params.len(), w.params.len(), "{at}");
            for ((gn, _, gv), (_, _, wv)) in g.grads.iter().zip(&w.grads) {
                let scale = wv.iter().fold(1e-300f64, |m, v| m.max(v.abs()));
                for (a, b) in gv.iter().zip(wv) {
                    let e = (a - b).abs() / scale;
                    assert!(e <= 1e-12, "{at}, rank {r}: grad {gn}: {a} vs {b} ({e:e})");
                    grad_worst = grad_worst.max(e);
                }
            }
        }
    }
    // Printed with --nocapture (the report quotes these).
    println!(
        "f64 FSDP GPT, cuda vs cpu: worst relative difference: losses {loss_worst:e}, \
         parameters {param_worst:e}, first-step gradients {grad_worst:e} (of each tensor's \
         largest |value|)"
    );
}

#[test]
fn f64_train_job_on_cuda_matches_the_cpu_cuda() {
    let _serial = crate::serial();
    use fsdp::train::{train, Precision, Silent, TrainConfig, TrainDevice};
    if gpus("f64_train_job_on_cuda_matches_the_cpu").is_none() {
        return;
    }
    let data = common::corpus_file("f64-device-job");
    let job = |device| TrainConfig {
        mixed_precision: Precision::F64,
        device,
        steps: 5,
        log_every: 0,
        ..common::small_job(data.clone(), 2)
    };
    let run = |cfg: TrainConfig| train(&cfg, &Silent).unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
    let (cuda, cpu) = (run(job(TrainDevice::Cuda)), run(job(TrainDevice::Cpu)));
    let (a, b) = (cuda.losses(), cpu.losses());
    assert_eq!(a.len(), 5);
    // The f64 losses reach the report rounded to f32.
    for (s, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= 1e-6 * y, "step {s}: cuda {x} vs cpu {y}");
    }
    println!("f64 train job, cuda vs cpu losses: {a:?} vs {b:?}");
    // From step 2 on: no device allocation; no host wait on a step that reads nothing back
    // (with log_every 0 only the first and last steps read their losses). Without the
    // caching allocator (FSDP_CUDA_NO_CACHING=1) every tensor is a driver allocation,
    // and a free may wait: nothing to count then.
    if std::env::var("FSDP_CUDA_NO_CACHING").is_ok_and(|v| v == "1") {
        return;
    }
    let recs = &cuda.records;
    let last = recs.len() - 1;
    for (i, r) in recs.iter().enumerate().skip(1) {
        let c = &r.counters;
        assert_eq!(
            (c.device_allocs, c.fsdp_buffer_allocs, c.pinned_allocs),
            (0, 0, 0),
            "step {}: {c:?}",
            r.step
        );
        if i != last {
            assert_eq!(c.host_syncs, 0, "step {}: {c:?}", r.step);
        }
    }
}
