//! The device-dispatching ops of `fsdp::ops` against the CPU references of
//! `backend::cpu::{kernels, gemm}` and naive loops, and the optimizers on device tensors,
//! on every device (see tests/common/device.rs).

use crate::common;
use crate::device;
use crate::device_test;

use common::{assert_close, values};
use device::{check, ids_on, tensor_on};
use fsdp::backend::cpu::kernels as refs;
use fsdp::backend::Device;
use fsdp::ops::{self, HeadDims, MatmulDims, Pointwise, Transpose};
use fsdp::optim::{Adam, AdamConfig, AdamW, Optimizer, ParamGrad, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};
use fsdp::Error;

fn host(v: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape).unwrap()
}

fn host64(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>(), shape).unwrap()
}

/// Compares with the reference: bitwise for copies and elementwise ops (`rel` 0), else
/// within `rel` (on every device: the reference may sum in another order).
fn close(what: &str, dev: Device, got: &Tensor, want: &[f32], rel: f32) {
    assert_eq!(got.device(), dev, "{what}: wrong device");
    let g = got.to_vec_f32().unwrap();
    if rel == 0.0 {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&g), bits(want), "{what} on {dev}: not bitwise equal");
    } else {
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_close(&format!("{what} on {dev}"), &g, want, rel * scale, rel);
    }
}

fn naive_matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, t: Transpose) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let av = if t.a { a[p * m + i] } else { a[i * k + p] };
                let bv = if t.b { b[j * k + p] } else { b[p * n + j] };
                s += av as f64 * bv as f64;
            }
            out[i * n + j] = s as f32;
        }
    }
    out
}

device_test!(matmul_matches_the_cpu_gemm, |dev| {
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
        (2, 0, 3, 2),
    ] {
        for t in layouts {
            let (a, b) = (values(1, batch * m * k), values(2, batch * k * n));
            let c0 = values(3, batch * m * n);
            let d = MatmulDims::new(m, k, n, t);
            let (ad, bd) = (
                tensor_on(a.clone(), &[batch, m * k], dev),
                tensor_on(b.clone(), &[batch, k * n], dev),
            );
            for accumulate in [false, true] {
                let out = tensor_on(c0.clone(), &[batch, m, n], dev);
                ops::matmul_batched(&out, &ad, &bd, d, batch, accumulate)?;
                let mut want = Vec::new();
                let mut gemm = Vec::new();
                for i in 0..batch {
                    let (ai, bi) = (
                        &a[i * m * k..(i + 1) * m * k],
                        &b[i * k * n..(i + 1) * k * n],
                    );
                    let mut w = naive_matmul(ai, bi, m, k, n, t);
                    let mut g = c0[i * m * n..(i + 1) * m * n].to_vec();
                    fsdp::backend::cpu::gemm::matmul(&mut g, ai, bi, m, k, n, t, accumulate)?;
                    if accumulate {
                        w.iter_mut()
                            .zip(&c0[i * m * n..])
                            .for_each(|(w, c)| *w += c);
                    }
                    want.extend(w);
                    gemm.extend(g);
                }
                let what = format!("matmul {m}x{k}x{n} x{batch} {t:?} acc={accumulate}");
                close(&format!("{what} vs f64"), dev, &out, &want, 1e-5);
                if dev == Device::Cpu {
                    close(&format!("{what} vs the CPU gemm"), dev, &out, &gemm, 0.0);
                }
            }
        }
    }
    // Wrong sizes and aliasing are errors.
    let x = tensor_on(values(4, 6), &[2, 3], dev);
    let r = ops::matmul(&x, &x, &x, MatmulDims::new(2, 3, 2, Transpose::NT), false);
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
    let y = tensor_on(values(4, 4), &[2, 2], dev);
    let r = ops::matmul(&y, &y, &y, MatmulDims::new(2, 2, 2, Transpose::NN), false);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    Ok(())
});

fn bf16(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_f32())
        .collect()
}

device_test!(autocast_gemms_read_bf16_operands_with_f32_sums, |dev| {
    // Under autocast(bf16) a product is the f32-accumulated product of the operands rounded
    // to bf16 (on CUDA a bf16 x bf16 -> f32 cuBLAS GEMM): within f32 summation rounding of
    // the f64 product of the rounded operands, and clearly off the unrounded one.
    let (m, k, n, batch) = (5usize, 67usize, 3usize, 2usize);
    let (a, b) = (values(21, batch * m * k), values(22, batch * k * n));
    let (ad, bd) = (
        tensor_on(a.clone(), &[batch, m * k], dev),
        tensor_on(b.clone(), &[batch, k * n], dev),
    );
    let d = MatmulDims::new(m, k, n, Transpose::NN);
    let out = tensor_on(vec![0.0; batch * m * n], &[batch, m, n], dev);
    {
        let _lp = ops::autocast(Some(DType::BF16));
        assert_eq!(ops::gemm_dtype(), Some(DType::BF16));
        ops::matmul_batched(&out, &ad, &bd, d, batch, false)?;
    }
    assert_eq!(ops::gemm_dtype(), None, "the scope ends with its guard");
    let (ar, br) = (bf16(&a), bf16(&b));
    let per = |x: &[f32], y: &[f32]| -> Vec<f32> {
        (0..batch)
            .flat_map(|i| {
                naive_matmul(
                    &x[i * m * k..(i + 1) * m * k],
                    &y[i * k * n..(i + 1) * k * n],
                    m,
                    k,
                    n,
                    Transpose::NN,
                )
            })
            .collect()
    };
    let (want, exact) = (per(&ar, &br), per(&a, &b));
    close(
        "autocast matmul vs rounded operands",
        dev,
        &out,
        &want,
        1e-5,
    );
    let got = out.to_vec_f32()?;
    let off = got
        .iter()
        .zip(&exact)
        .map(|(g, e)| (g - e).abs())
        .fold(0.0, f32::max);
    assert!(
        off > 1e-4,
        "bf16 operands must show against f32 ones (max diff {off})"
    );
    // F.linear too, its bias added in f32; outside the scope it is f32 again.
    let (x, w, bias) = (values(23, 4 * k), values(24, 3 * k), values(25, 3));
    let (xt, wt, bt) = (
        tensor_on(x.clone(), &[4, k], dev),
        tensor_on(w.clone(), &[3, k], dev),
        tensor_on(bias.clone(), &[3], dev),
    );
    let y = {
        let _lp = ops::autocast(Some(DType::BF16));
        ops::linear(&xt, &wt, Some(&bt))?
    };
    let mut want = naive_matmul(&bf16(&x), &bf16(&w), 4, k, 3, Transpose::NT);
    want.iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v += bias[i % 3]);
    close("autocast linear", dev, &y, &want, 1e-5);
    let y32 = ops::linear(&xt, &wt, Some(&bt))?;
    let mut want = naive_matmul(&x, &w, 4, k, 3, Transpose::NT);
    want.iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v += bias[i % 3]);
    close("linear after the scope", dev, &y32, &want, 1e-5);
    Ok(())
});

device_test!(linear_and_bias_ops_match_the_references, |dev| {
    let (n, i, o) = (5usize, 7usize, 3usize);
    let (x, w, b) = (values(5, n * i), values(6, o * i), values(7, o));
    let y = ops::linear(
        &tensor_on(x.clone(), &[n, i], dev),
        &tensor_on(w.clone(), &[o, i], dev),
        Some(&tensor_on(b.clone(), &[o], dev)),
    )?;
    let mut want = naive_matmul(&x, &w, n, i, o, Transpose::NT);
    want.iter_mut()
        .enumerate()
        .for_each(|(k, v)| *v += b[k % o]);
    close("linear", dev, &y, &want, 1e-5);
    assert_eq!(y.shape(), [n, o]);
    for (rows, c) in [(0usize, 3usize), (1, 1), (13, 7), (75, 70), (64, 32)] {
        let (yv, bv, db0) = (values(8, rows * c), values(9, c), values(10, c));
        let (yt, dbt) = (
            tensor_on(yv.clone(), &[rows, c], dev),
            tensor_on(db0.clone(), &[c], dev),
        );
        ops::bias_add_(&yt, &tensor_on(bv.clone(), &[c], dev))?;
        let mut want = yv.clone();
        refs::bias_add(&mut want, &bv)?;
        close("bias_add_", dev, &yt, &want, 0.0);
        ops::bias_grad(&tensor_on(yv.clone(), &[rows, c], dev), &dbt)?;
        let mut want = db0.clone();
        refs::bias_grad(&yv, &mut want)?;
        close("bias_grad", dev, &dbt, &want, 1e-6);
    }
    Ok(())
});

device_test!(pointwise_ops_are_the_references_bitwise, |dev| {
    let n = 1031;
    let (x, dy) = (
        values(11, n).iter().map(|v| v * 6.0).collect::<Vec<_>>(),
        values(12, n),
    );
    let (xt, dyt) = (
        tensor_on(x.clone(), &[n], dev),
        tensor_on(dy.clone(), &[n], dev),
    );
    let mut want = vec![0.0; n];
    refs::gelu_fwd(&x, &mut want)?;
    close(
        "gelu",
        dev,
        &ops::pointwise(Pointwise::Gelu, &xt)?,
        &want,
        0.0,
    );
    refs::gelu_bwd(&x, &dy, &mut want)?;
    close(
        "gelu backward",
        dev,
        &ops::pointwise_backward(Pointwise::Gelu, &xt, &dyt)?,
        &want,
        0.0,
    );
    refs::relu_fwd(&x, &mut want)?;
    close(
        "relu",
        dev,
        &ops::pointwise(Pointwise::Relu, &xt)?,
        &want,
        0.0,
    );
    refs::relu_bwd(&x, &dy, &mut want)?;
    close(
        "relu backward",
        dev,
        &ops::pointwise_backward(Pointwise::Relu, &xt, &dyt)?,
        &want,
        0.0,
    );
    let r = ops::pointwise(Pointwise::Relu, &Tensor::zeros_on(&[3], DType::I32, dev)?);
    assert!(matches!(r, Err(Error::DTypeMismatch { .. })), "{r:?}");
    Ok(())
});

device_test!(layer_norm_matches_the_references, |dev| {
    for (rows, c) in [(1usize, 1usize), (7, 13), (3, 257)] {
        let (x, w, b) = (values(13, rows * c), values(14, c), values(15, c));
        let dy = values(16, rows * c);
        let (mut y, mut xhat, mut rstd) =
            (vec![0.0; rows * c], vec![0.0; rows * c], vec![0.0; rows]);
        refs::layernorm_fwd(&x, &w, &b, 1e-5, &mut y, &mut xhat, &mut rstd)?;
        let wt = tensor_on(w.clone(), &[c], dev);
        let (yt, saved) = ops::layer_norm(
            &tensor_on(x, &[rows, c], dev),
            &wt,
            &tensor_on(b, &[c], dev),
            1e-5,
        )?;
        let rel = if dev == Device::Cpu { 0.0 } else { 1e-5 };
        close("layer_norm y", dev, &yt, &y, rel);
        close("layer_norm xhat", dev, &saved.xhat, &xhat, rel);
        close("layer_norm rstd", dev, &saved.rstd, &rstd, rel);
        let (dw0, db0) = (values(17, c), values(18, c));
        let (dwt, dbt) = (
            tensor_on(dw0.clone(), &[c], dev),
            tensor_on(db0.clone(), &[c], dev),
        );
        let dx = ops::layer_norm_backward(
            &tensor_on(dy.clone(), &[rows, c], dev),
            &saved,
            &wt,
            Some(&dwt),
            Some(&dbt),
        )?;
        let (mut wdx, mut wdw, mut wdb) = (vec![0.0; rows * c], dw0, db0);
        refs::layernorm_bwd(&dy, &xhat, &rstd, &w, &mut wdx)?;
        refs::layernorm_bwd_params(&dy, &xhat, &mut wdw, &mut wdb)?;
        close("layer_norm dx", dev, &dx, &wdx, 1e-5);
        close("layer_norm dw", dev, &dwt, &wdw, 1e-5);
        close("layer_norm db", dev, &dbt, &wdb, 1e-5);
        // Frozen parameters: no gradient given, dx unchanged.
        let dx2 =
            ops::layer_norm_backward(&tensor_on(dy, &[rows, c], dev), &saved, &wt, None, None)?;
        close("layer_norm dx (frozen)", dev, &dx2, &dx.to_vec_f32()?, 0.0);
    }
    Ok(())
});

/// f64 bits of a tensor (f32 or f64), for bitwise comparisons of either dtype.
fn bits64(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

device_test!(
    residual_add_layer_norm_is_add_then_layer_norm_bitwise,
    |dev| {
        // The GPT block's fused residual adds (one kernel each on CUDA) against the two ops they
        // replace, on the same device, bitwise: `add_layer_norm` = `add` then `layer_norm`,
        // `layer_norm_backward_add` = `layer_norm_backward` then `add` (dw, db included). Sizes:
        // one element, primes, a row of 1031 (1024-thread rows, 33 column blocks), 40 rows.
        for dtype in [DType::F32, DType::F64] {
            for (rows, c) in [(1usize, 1usize), (7, 13), (40, 32), (3, 257), (2, 1031)] {
                let on = |seed: u64, n: usize, shape: &[usize]| -> Tensor {
                    let v = values(seed, n);
                    let t = match dtype {
                        DType::F64 => host64(&v, shape),
                        _ => host(v, shape),
                    };
                    t.to_device(dev).unwrap()
                };
                let (x, r) = (on(20, rows * c, &[rows, c]), on(21, rows * c, &[rows, c]));
                let (w, b) = (on(22, c, &[c]), on(23, c, &[c]));
                let what = format!("{dtype} {rows}x{c} on {dev}");
                let (sum, y, saved) = ops::add_layer_norm(&x, &r, &w, &b, 1e-5)?;
                let sum0 = ops::add(&x, &r)?;
                let (y0, saved0) = ops::layer_norm(&sum0, &w, &b, 1e-5)?;
                assert_eq!(bits64(&sum), bits64(&sum0), "x + r, {what}");
                assert_eq!(bits64(&y), bits64(&y0), "y, {what}");
                assert_eq!(bits64(&saved.xhat), bits64(&saved0.xhat), "xhat, {what}");
                assert_eq!(bits64(&saved.rstd), bits64(&saved0.rstd), "rstd, {what}");
                let (dy, res) = (on(24, rows * c, &[rows, c]), on(25, rows * c, &[rows, c]));
                let (dw, db, rdb) = (on(26, c, &[c]), on(27, c, &[c]), on(28, c, &[c]));
                let (dw0, db0, rdb0) = (dw.deep_clone()?, db.deep_clone()?, rdb.deep_clone()?);
                let dx = ops::layer_norm_backward_add(
                    &dy,
                    &saved,
                    &w,
                    Some(&dw),
                    Some(&db),
                    &res,
                    Some(&rdb),
                )?;
                let dx0 = ops::add(
                    &res,
                    &ops::layer_norm_backward(&dy, &saved0, &w, Some(&dw0), Some(&db0))?,
                )?;
                assert_eq!(bits64(&dx), bits64(&dx0), "res + dx, {what}");
                assert_eq!(bits64(&dw), bits64(&dw0), "dw, {what}");
                assert_eq!(bits64(&db), bits64(&db0), "db, {what}");
                // The deferred bias gradient: the column sums of the residual's gradient.
                ops::bias_grad(&res, &rdb0)?;
                assert_eq!(bits64(&rdb), bits64(&rdb0), "bias grad of res, {what}");
                // Frozen parameters (no gradients), no deferred bias: dx the same.
                let dx2 = ops::layer_norm_backward_add(&dy, &saved, &w, None, None, &res, None)?;
                assert_eq!(bits64(&dx2), bits64(&dx), "res + dx (frozen), {what}");
                if dtype == DType::F32 {
                    // And the CPU reference loops of x + r.
                    let xr: Vec<f32> = (values(20, rows * c).iter())
                        .zip(&values(21, rows * c))
                        .map(|(a, b)| a + b)
                        .collect();
                    let (mut yr, mut xh, mut rs) =
                        (vec![0.0; rows * c], vec![0.0; rows * c], vec![0.0; rows]);
                    let (wv, bv) = (values(22, c), values(23, c));
                    refs::layernorm_fwd(&xr, &wv, &bv, 1e-5, &mut yr, &mut xh, &mut rs)?;
                    let rel = if dev == Device::Cpu { 0.0 } else { 1e-5 };
                    close("add_layer_norm x + r", dev, &sum, &xr, 0.0);
                    close("add_layer_norm y", dev, &y, &yr, rel);
                }
            }
        }
        // A residual of another shape: refused, as `add` refuses it.
        let x = tensor_on(values(1, 6), &[2, 3], dev);
        let (w, b) = (
            tensor_on(values(2, 3), &[3], dev),
            tensor_on(values(3, 3), &[3], dev),
        );
        let bad = ops::add_layer_norm(&x, &tensor_on(values(4, 4), &[4], dev), &w, &b, 1e-5);
        assert!(bad.is_err(), "a residual of 4 elements for 6 was taken");
        Ok(())
    }
);

device_test!(bias_gelu_and_its_backward_are_the_two_ops_bitwise, |dev| {
    // The MLP's fused bias + GELU (one kernel each way on CUDA) against the ops they
    // replace, on the same device, bitwise: `bias_gelu_` = `bias_add_` then GELU,
    // `gelu_backward_bias_grad` = GELU's backward then `bias_grad`; and (f32) against the
    // same ops on the CPU. Sizes: one element, primes, 1031 columns (33 column blocks).
    for dtype in [DType::F32, DType::F64] {
        for (rows, c) in [(1usize, 1usize), (7, 13), (40, 128), (3, 1031)] {
            let on = |seed: u64, n: usize, shape: &[usize], d: Device| -> Tensor {
                let v: Vec<f32> = values(seed, n).iter().map(|x| 3.0 * x).collect();
                let t = match dtype {
                    DType::F64 => host64(&v, shape),
                    _ => host(v, shape),
                };
                t.to_device(d).unwrap()
            };
            let what = format!("{dtype} {rows}x{c} on {dev}");
            let (h, b) = (on(30, rows * c, &[rows, c], dev), on(31, c, &[c], dev));
            let h0 = h.deep_clone()?;
            let y = ops::bias_gelu_(&h, &b)?;
            ops::bias_add_(&h0, &b)?;
            let y0 = ops::pointwise(Pointwise::Gelu, &h0)?;
            assert_eq!(bits64(&h), bits64(&h0), "h + b, {what}");
            assert_eq!(bits64(&y), bits64(&y0), "gelu(h + b), {what}");
            let dy = on(32, rows * c, &[rows, c], dev);
            let (db, db0) = (on(33, c, &[c], dev), on(33, c, &[c], dev));
            let fused = ops::gelu_backward_bias_grad(&h, &dy, &db)?;
            let dx0 = ops::pointwise_backward(Pointwise::Gelu, &h0, &dy)?;
            ops::bias_grad(&dx0, &db0)?;
            match fused {
                Some(dx) => {
                    assert_eq!(bits64(&dx), bits64(&dx0), "dx, {what}");
                    assert_eq!(bits64(&db), bits64(&db0), "db, {what}");
                }
                // The CPU fuses f32 on one intra-op thread only; CUDA always.
                None => assert!(dev == Device::Cpu, "not fused on {dev}: {what}"),
            }
            if dtype == DType::F32 && dev != Device::Cpu {
                let (hc, bc) = (
                    on(30, rows * c, &[rows, c], Device::Cpu),
                    on(31, c, &[c], Device::Cpu),
                );
                let yc = ops::bias_gelu_(&hc, &bc)?;
                close("bias_gelu_ y vs the CPU", dev, &y, &yc.to_vec_f32()?, 0.0);
                let dbc = on(33, c, &[c], Device::Cpu);
                let dxc =
                    ops::pointwise_backward(Pointwise::Gelu, &hc, &dy.to_device(Device::Cpu)?)?;
                ops::bias_grad(&dxc, &dbc)?;
                close(
                    "gelu backward dx vs the CPU",
                    dev,
                    &dx0,
                    &dxc.to_vec_f32()?,
                    0.0,
                );
                close("bias grad vs the CPU", dev, &db0, &dbc.to_vec_f32()?, 1e-5);
            }
        }
    }
    Ok(())
});

device_test!(attention_ops_match_the_references, |dev| {
    for d in [
        HeadDims {
            b: 1,
            t: 1,
            h: 1,
            hd: 1,
        },
        HeadDims {
            b: 2,
            t: 5,
            h: 3,
            hd: 7,
        },
        HeadDims {
            b: 3,
            t: 17,
            h: 2,
            hd: 4,
        },
    ] {
        let (n, c) = (d.numel(), d.h * d.hd);
        let qkv = values(19, 3 * n);
        let [q, k, v] = ops::split_qkv(&tensor_on(qkv.clone(), &[d.b, d.t, 3 * c], dev), d)?;
        let (mut wq, mut wk, mut wv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        refs::split_qkv(&qkv, &mut wq, &mut wk, &mut wv, d)?;
        close("split_qkv q", dev, &q, &wq, 0.0);
        close("split_qkv k", dev, &k, &wk, 0.0);
        close("split_qkv v", dev, &v, &wv, 0.0);
        assert_eq!(q.shape(), [d.b, d.h, d.t, d.hd]);
        close("merge_qkv", dev, &ops::merge_qkv(&q, &k, &v, d)?, &qkv, 0.0);
        let y = ops::merge_heads(&q, d)?;
        let mut wy = vec![0.0; n];
        refs::merge_heads(&wq, &mut wy, d)?;
        close("merge_heads", dev, &y, &wy, 0.0);
        assert_eq!(y.shape(), [d.b, d.t, c]);
        close("split_heads", dev, &ops::split_heads(&y, d)?, &wq, 0.0);
        // Causal softmax and its backward over (B, H, T, T) scores.
        let rows = d.b * d.h * d.t;
        let s: Vec<f32> = values(20, rows * d.t).iter().map(|v| v * 8.0).collect();
        let dp = values(21, rows * d.t);
        let scale = 1.0 / (d.hd as f32).sqrt();
        let p = ops::softmax_causal(
            &tensor_on(s.clone(), &[d.b, d.h, d.t, d.t], dev),
            d.t,
            scale,
        )?;
        let mut wp = vec![0.0; s.len()];
        refs::softmax_causal_fwd(&s, &mut wp, d.t, scale)?;
        let rel = if dev == Device::Cpu { 0.0 } else { 1e-5 };
        close("softmax_causal", dev, &p, &wp, rel);
        let dpt = tensor_on(dp.clone(), &[d.b, d.h, d.t, d.t], dev);
        ops::softmax_causal_backward_(&p, &dpt, d.t, scale)?;
        let mut wds = dp;
        refs::softmax_causal_bwd(&wp, &mut wds, d.t, scale)?;
        close("softmax_causal_backward_", dev, &dpt, &wds, rel);
    }
    Ok(())
});

device_test!(embedding_and_cross_entropy_match_the_references, |dev| {
    let (v, c) = (11usize, 5usize);
    let table = values(22, v * c);
    let ids: Vec<i32> = (0..13).map(|i| (i * 4 % v) as i32).collect();
    let tt = tensor_on(table.clone(), &[v, c], dev);
    let out = ops::embedding(&tt, &ids_on(ids.clone(), &[13], dev))?;
    let mut want = vec![0.0; 13 * c];
    refs::embedding_fwd(&ids, &table, c, &mut want)?;
    close("embedding", dev, &out, &want, 0.0);
    assert_eq!(out.shape(), [13, c]);
    let (dout, g0) = (values(23, 13 * c), values(24, v * c));
    let g = tensor_on(g0.clone(), &[v, c], dev);
    ops::embedding_backward(
        &ids_on(ids.clone(), &[13], dev),
        &tensor_on(dout.clone(), &[13, c], dev),
        &g,
    )?;
    let mut want = g0;
    refs::embedding_bwd(&ids, &dout, c, &mut want)?;
    close(
        "embedding_backward",
        dev,
        &g,
        &want,
        if dev == Device::Cpu { 0.0 } else { 1e-6 },
    );
    // On CUDA the ids are checked on the device and the error comes with the next host
    // read (a device-side assert, named); on the CPU at once.
    let bad = ops::embedding(&tt, &ids_on(vec![1, 11], &[2], dev)).and_then(|y| y.to_vec_f32());
    assert!(
        matches!(&bad, Err(Error::InvalidArgument(m)) if m.contains("position 1")),
        "{bad:?}"
    );
    // Cross-entropy: the mean of the reference's row losses, and its gradient.
    let (n, vv) = (7usize, 13usize);
    let logits: Vec<f32> = values(25, n * vv).iter().map(|x| x * 5.0).collect();
    let targets: Vec<i32> = (0..n).map(|i| ((i * 5 + 2) % vv) as i32).collect();
    let (loss, grad) = ops::cross_entropy(
        &tensor_on(logits.clone(), &[n, vv], dev),
        &ids_on(targets.clone(), &[n], dev),
    )?;
    let (mut wl, mut wg) = (vec![0.0; n], vec![0.0; n * vv]);
    refs::cross_entropy(&logits, &targets, 1.0 / n as f32, &mut wl, &mut wg)?;
    let want = (wl.iter().map(|&l| l as f64).sum::<f64>() / n as f64) as f32;
    let rel = if dev == Device::Cpu { 0.0 } else { 1e-5 };
    assert!(
        (loss - want).abs() <= rel * want.abs(),
        "loss {loss} vs {want}"
    );
    close("cross_entropy grad", dev, &grad, &wg, rel);
    let r = ops::cross_entropy(&tensor_on(logits, &[n, vv], dev), &host(vec![0.0; n], &[n]));
    assert!(
        matches!(r, Err(Error::ShapeMismatch { .. })),
        "f32 targets: {r:?}"
    );
    Ok(())
});

device_test!(ops_refuse_mixed_devices_and_meta, |dev| {
    let meta = Tensor::meta(&[2, 3], DType::F32);
    let r = ops::pointwise(Pointwise::Gelu, &meta);
    assert!(matches!(r, Err(Error::NotMaterialized { .. })), "{r:?}");
    if dev != Device::Cpu {
        let (a, b) = (tensor_on(values(1, 6), &[6], dev), host(values(2, 6), &[6]));
        let r = ops::add(&a, &b);
        assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
        let r = ops::bias_grad(&a, &b);
        assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
    }
    let s = ops::add(
        &tensor_on(values(1, 6), &[2, 3], dev),
        &tensor_on(values(2, 6), &[2, 3], dev),
    )?;
    let want: Vec<f32> = values(1, 6)
        .iter()
        .zip(values(2, 6))
        .map(|(a, b)| a + b)
        .collect();
    close("add", dev, &s, &want, 0.0);
    Ok(())
});

/// Builds a fresh optimizer.
type MakeOptimizer = Box<dyn Fn() -> Box<dyn Optimizer>>;

/// The optimizer kinds under test, with momentum, Nesterov and weight decay.
fn optimizers() -> Vec<(&'static str, MakeOptimizer)> {
    let sgd = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 0.01,
        nesterov: false,
    };
    vec![
        (
            "sgd",
            Box::new(|| {
                Box::new(SGD::new(SgdConfig {
                    lr: 0.05,
                    ..SgdConfig::default()
                })) as Box<dyn Optimizer>
            }),
        ),
        (
            "sgd momentum",
            Box::new(move || Box::new(SGD::new(sgd)) as Box<dyn Optimizer>),
        ),
        (
            "sgd nesterov",
            Box::new(move || {
                Box::new(SGD::new(SgdConfig {
                    nesterov: true,
                    dampening: 0.0,
                    ..sgd
                })) as Box<dyn Optimizer>
            }),
        ),
        (
            "adam",
            Box::new(|| {
                Box::new(Adam::new(AdamConfig {
                    weight_decay: 0.1,
                    ..AdamConfig::adam()
                })) as Box<dyn Optimizer>
            }),
        ),
        (
            "adamw",
            Box::new(|| {
                Box::new(AdamW::new(AdamConfig {
                    lr: 0.01,
                    ..AdamConfig::adamw()
                })) as Box<dyn Optimizer>
            }),
        ),
    ]
}

/// Parameters of awkward sizes (one without a gradient) on `dev`, the `k`-th on the CPU
/// when `mixed` (a list may hold tensors of several devices).
fn param_list(dev: Device, mixed: bool) -> Vec<ParamGrad> {
    [1usize, 0, 7, 1031, 33]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let d = if mixed && i == 2 { Device::Cpu } else { dev };
            ParamGrad {
                param: tensor_on(values(30 + i as u64, n), &[n], d),
                grad: (i != 4).then(|| tensor_on(values(40 + i as u64, n), &[n], d)),
            }
        })
        .collect()
}

device_test!(optimizers_step_on_device_tensors_bitwise, |dev| {
    for (name, make) in optimizers() {
        let (cpu, on_dev, mixed) = (
            param_list(Device::Cpu, false),
            param_list(dev, false),
            param_list(dev, true),
        );
        let (mut oc, mut od, mut om) = (make(), make(), make());
        for _ in 0..3 {
            oc.step(&cpu)?;
            od.step(&on_dev)?;
            om.step(&mixed)?;
        }
        assert_eq!(oc.state_bytes(), od.state_bytes(), "{name} state bytes");
        for (i, ((c, d), m)) in cpu.iter().zip(&on_dev).zip(&mixed).enumerate() {
            close(
                &format!("{name} param {i}"),
                dev,
                &d.param,
                &c.param.to_vec_f32()?,
                0.0,
            );
            let mp = m.param.to_vec_f32()?;
            assert_eq!(
                mp,
                c.param.to_vec_f32()?,
                "{name} param {i} in a mixed list"
            );
        }
        // The state comes back to the host, the same on both devices; loaded into a new
        // optimizer it moves to the device at the next step and the run continues alike.
        let (sc, sd) = (oc.state_dict()?, od.state_dict()?);
        assert_eq!(sc, sd, "{name} state dict");
        let mut od2 = make();
        od2.load_state_dict(&sd)?;
        oc.step(&cpu)?;
        od2.step(&on_dev)?;
        for (i, (c, d)) in cpu.iter().zip(&on_dev).enumerate() {
            close(
                &format!("{name} param {i} after a reload"),
                dev,
                &d.param,
                &c.param.to_vec_f32()?,
                0.0,
            );
        }
        assert_eq!(
            oc.state_dict()?,
            od2.state_dict()?,
            "{name} state after a reload"
        );
    }
    // A gradient on another device than its parameter is an error.
    if dev != Device::Cpu {
        let bad = vec![ParamGrad {
            param: tensor_on(values(1, 3), &[3], dev),
            grad: Some(host(values(2, 3), &[3])),
        }];
        let r = SGD::new(SgdConfig::default()).step(&bad);
        assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
    }
    Ok(())
});

device_test!(parameter_grads_live_on_the_parameter_device, |dev| {
    let mut p = fsdp::nn::Parameter::new("w", tensor_on(values(1, 6), &[2, 3], dev));
    assert_eq!(p.device(), dev);
    let g = p.grad_for_accumulate()?.expect("trainable").clone();
    assert_eq!((g.device(), g.shape()), (dev, &[2usize, 3][..]));
    check(
        "fresh grad",
        dev,
        &g,
        &Tensor::zeros(&[2, 3], DType::F32),
        0.0,
    );
    p.set_data(None)?;
    assert_eq!(p.device(), dev, "the device is kept while the data is away");
    p.requires_grad = false;
    assert!(p.grad_for_accumulate()?.is_none());
    Ok(())
});

/// `clip_grad_norm_`'s multi-tensor launches (every unit's shard in one list) against the
/// per-tensor ones they replace, bitwise: the f64 sum of squares and its f32 rounding, the
/// clip coefficient read from the f32 total, and the scaling. f32 and f64 lists with empty,
/// one-element and odd sizes.
#[cfg(feature = "cuda")]
#[test]
fn clip_multi_tensor_launches_are_the_per_tensor_ones_bitwise_cuda() {
    use fsdp::backend::cuda::{
        current_stream, scale_all_by, scale_by, NormAccumulator, TensorList,
    };
    let dev = match device::cuda_device() {
        Ok(d) => d,
        Err(why) => return eprintln!("skipping clip_multi_tensor_launches on CUDA: {why}"),
    };
    let s = current_stream(0).unwrap();
    for dtype in [DType::F32, DType::F64] {
        let sizes = [1usize, 0, 7, 1000, 70001];
        let make = |k: u64| -> Vec<Tensor> {
            sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let v = values(40 + k + i as u64, n);
                    let t = match dtype {
                        DType::F64 => host64(&v, &[n]),
                        _ => host(v, &[n]),
                    };
                    t.to_device(dev).unwrap()
                })
                .collect()
        };
        let (one, all) = (make(0), make(0));
        let dts = |ts: &[Tensor]| -> Vec<_> {
            ts.iter().map(|t| t.as_device_tensor().unwrap()).collect()
        };
        let scalar = |d: DType| Tensor::zeros_on(&[1], d, dev).unwrap();
        // The sums: per tensor into a zeroed accumulator, and one list.
        let acc1 = NormAccumulator::zeros(&s).unwrap();
        for t in dts(&one) {
            acc1.add_squares(&s, &t).unwrap();
        }
        let (f1, d1) = (scalar(DType::F32), scalar(DType::F64));
        acc1.store(&s, &f1.as_device_tensor().unwrap()).unwrap();
        acc1.store(&s, &d1.as_device_tensor().unwrap()).unwrap();
        let list = TensorList::new(&s, &dts(&all)).unwrap();
        let acc2 = NormAccumulator::unset(&s).unwrap();
        let (f2, d2) = (scalar(DType::F32), scalar(DType::F64));
        acc2.set_squares(&s, &list, Some(&f2.as_device_tensor().unwrap()))
            .unwrap();
        acc2.store(&s, &d2.as_device_tensor().unwrap()).unwrap();
        assert_eq!(bits64(&f1), bits64(&f2), "{dtype}: f32 sum of squares");
        assert_eq!(bits64(&d1), bits64(&d2), "{dtype}: f64 sum of squares");
        let want: f64 = (0..sizes.len())
            .flat_map(|i| values(40 + i as u64, sizes[i]))
            .map(|v| f64::from(v) * f64::from(v))
            .sum();
        let got = d2.to_vec_f64().unwrap()[0];
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "{dtype}: sum {got} vs {want}"
        );
        // The coefficient: load then clip_coef, and clip_coef_of the f32 total.
        let (n1, c1, n2, c2) = (
            scalar(DType::F32),
            scalar(dtype),
            scalar(DType::F32),
            scalar(dtype),
        );
        acc1.load(&s, &f1.as_device_tensor().unwrap()).unwrap();
        acc1.clip_coef(
            &s,
            0.5,
            &n1.as_device_tensor().unwrap(),
            &c1.as_device_tensor().unwrap(),
        )
        .unwrap();
        acc2.clip_coef_of(
            &s,
            &f2.as_device_tensor().unwrap(),
            0.5,
            &n2.as_device_tensor().unwrap(),
            &c2.as_device_tensor().unwrap(),
        )
        .unwrap();
        assert_eq!(bits64(&n1), bits64(&n2), "{dtype}: norm");
        assert_eq!(bits64(&c1), bits64(&c2), "{dtype}: coefficient");
        assert!(
            c1.to_vec_f64().unwrap()[0] < 1.0,
            "{dtype}: the norm must clip"
        );
        // The scaling.
        let coef = c1.as_device_tensor().unwrap();
        for t in dts(&one) {
            scale_by(&s, &t, &coef).unwrap();
        }
        scale_all_by(&s, &list, &coef).unwrap();
        for (a, b) in one.iter().zip(&all) {
            assert_eq!(
                bits64(a),
                bits64(b),
                "{dtype}: scaled tensor of {}",
                a.numel()
            );
        }
        // A list of another dtype than the coefficient: refused.
        let other = match dtype {
            DType::F64 => scalar(DType::F32),
            _ => scalar(DType::F64),
        };
        assert!(scale_all_by(&s, &list, &other.as_device_tensor().unwrap()).is_err());
    }
}
