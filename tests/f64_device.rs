//! f64 on each device: matrix products of float64 tensors in f64 (host loops on the CPU,
//! cuBLAS with `CUBLAS_COMPUTE_64F` on CUDA) against an f64 reference, and the f64 ops that
//! have no CUDA kernel refusing f64 CUDA tensors with an error that names them.

mod common;
#[path = "common/device.rs"]
mod device;

use fsdp::backend::Device;
use fsdp::ops::{self, MatmulDims, Pointwise, Transpose};
use fsdp::tensor::Tensor;

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

device_test!(f64_ops_without_cuda_kernels_name_themselves, |dev| {
    let x = on(wave(12, 0.4), &[3, 4], dev);
    let (w, b) = (on(wave(4, 1.0), &[4], dev), on(wave(4, 2.0), &[4], dev));
    let results = [
        ("GELU", ops::pointwise(Pointwise::Gelu, &x).map(|_| ())),
        ("layer_norm", ops::layer_norm(&x, &w, &b, 1e-5).map(|_| ())),
        (
            "softmax_causal",
            ops::softmax_causal(&on(wave(16, 0.0), &[4, 4], dev), 4, 0.5).map(|_| ()),
        ),
    ];
    for (op, r) in results {
        match (dev, r) {
            (Device::Cpu, r) => r.unwrap_or_else(|e| panic!("{op} on the CPU: {e}")),
            (_, Ok(())) => panic!("{op} of f64 CUDA tensors ran: it has no kernel"),
            (_, Err(e)) => {
                let s = e.to_string();
                assert!(s.contains(op) && s.contains("f64"), "{op}: {s}");
            }
        }
    }
    Ok(())
});

device_test!(f64_fsdp_runs_on_the_cpu_and_refuses_cuda_clearly, |dev| {
    use fsdp::distributed::{launch, LaunchOptions};
    use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel};
    use fsdp::nn::{self, InitKey, Linear};
    let out = launch(&LaunchOptions::new(1), move |pg| {
        let mut m = Linear::new(3, 2, true, &InitKey::new(1))?;
        nn::module_to_dtype(&mut m, fsdp::tensor::DType::F64)?;
        let cfg = FsdpConfig {
            device_id: Some(dev),
            ..FsdpConfig::default()
        };
        Ok(FullyShardedDataParallel::new(Box::new(m), pg, cfg).map(|_| ()))
    })?;
    match (dev, &out[0]) {
        (Device::Cpu, r) => assert!(r.is_ok(), "{r:?}"),
        (_, Ok(())) => panic!("f64 FSDP on {dev} was accepted: it has no f64 layer kernels"),
        (_, Err(e)) => {
            let s = e.to_string();
            assert!(s.contains("f64") && s.contains("cuda"), "{s}");
        }
    }
    Ok(())
});
