//! Every kernel of `kernels/*.cu` against the product code it must reproduce, written once
//! and run on each backend (`<test>_cpu` checks the CPU references, `<test>_cuda` the CUDA
//! kernels and prints a skip notice without a GPU). Exact where the computation is
//! elementwise or a plain copy; dtype-aware tolerances where reductions may sum in another
//! order. Sizes include 0, 1, primes and sizes no world size divides.

use crate::backend;
use crate::backend_test;
use crate::common;

use backend::Backend;
use common::values;
use fsdp::fsdp::FlatParameter;
use fsdp::nn::{Context, Module};
use fsdp::tensor::{DType, Element, Tensor};
use fsdp::Result;
use half::{bf16, f16};

/// Awkward element counts: empty, one, primes, just past powers of two.
const SIZES: &[usize] = &[0, 1, 2, 7, 31, 257, 1031, 4099];

/// Each element's bits as a `u64`, for exact comparison. A NaN compares by its sign only:
/// payloads are implementation-defined, and CUDA's conversions and arithmetic return the
/// canonical NaN (`0x7fff` for bf16/f16 from `cvt.rn.{bf16,f16}.f32`, `0x7fffffff` for
/// f32 results), where the `half` crate and x86 keep the payload (`0x7fc0`, `0x7e00`,
/// `0x7fc00000`). The all-ones poison of elements a kernel failed to write is a negative
/// NaN, so it still shows against a positive one.
fn bits<T: Element>(x: &[T]) -> Vec<u64> {
    x.iter()
        .map(|v| {
            let f = v.to_f32();
            if f.is_nan() {
                return if f.is_sign_negative() {
                    u64::MAX
                } else {
                    u64::MAX - 1
                };
            }
            let b = bytemuck::bytes_of(v);
            b.iter().rev().fold(0u64, |a, &c| (a << 8) | c as u64)
        })
        .collect()
}

/// Bitwise equality (NaNs by sign, see [`bits`]), with the first differences on failure.
fn assert_bits<T: Element>(what: &str, b: &Backend, got: &[T], want: &[T]) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what} on {}: lengths differ",
        b.name()
    );
    let (g, w) = (bits(got), bits(want));
    let bad: Vec<usize> = (0..g.len()).filter(|&i| g[i] != w[i]).collect();
    assert!(
        bad.is_empty(),
        "{what} on {}: {} of {} differ; first: {:?}",
        b.name(),
        bad.len(),
        g.len(),
        bad.iter()
            .take(5)
            .map(|&i| (i, got[i], want[i]))
            .collect::<Vec<_>>()
    );
}

/// Inputs with the values casts get wrong: signed zeros, infinities, NaN, subnormals, ties,
/// values past f16's range, then ordinary values.
fn tricky(n: usize, seed: u64) -> Vec<f32> {
    let special = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e-40,
        -3e-39,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        70000.0,
        -65520.0,
        6.0e-8,
    ];
    let v = values(seed, n);
    (0..n)
        .map(|i| special.get(i).copied().unwrap_or(v[i] * 8.0))
        .collect()
}

fn to<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

backend_test!(copy_and_fill_every_dtype, |b| {
    for &n in SIZES {
        let x = tricky(n, 1);
        assert_bits("copy f32", b, &b.copy(&x)?, &x);
        assert_bits("copy bf16", b, &b.copy(&to::<bf16>(&x))?, &to::<bf16>(&x));
        assert_bits("copy f16", b, &b.copy(&to::<f16>(&x))?, &to::<f16>(&x));
        let ids: Vec<i32> = (0..n as i32).map(|i| i * 7 - 3).collect();
        assert_bits("copy i32", b, &b.copy(&ids)?, &ids);
        assert_bits("fill f32", b, &b.fill::<f32>(n, -1.5)?, &vec![-1.5f32; n]);
        assert_bits(
            "fill bf16",
            b,
            &b.fill::<bf16>(n, 0.1)?,
            &vec![bf16::from_f32(0.1); n],
        );
        assert_bits(
            "fill f16",
            b,
            &b.fill::<f16>(n, 0.1)?,
            &vec![f16::from_f32(0.1); n],
        );
        assert_bits("fill i32", b, &b.fill::<i32>(n, 7.0)?, &vec![7i32; n]);
    }
    Ok(())
});

backend_test!(pad_copy_makes_the_flat_parameter_shards, |b| {
    for &n in &[0usize, 1, 5, 13, 33, 100] {
        for w in [1usize, 2, 3, 4, 8] {
            let split = n / 3;
            let all = values(n as u64, n);
            let params = vec![
                (
                    "a".to_string(),
                    Tensor::from_vec(all[..split].to_vec(), &[split])?,
                    true,
                ),
                (
                    "b".to_string(),
                    Tensor::from_vec(all[split..].to_vec(), &[n - split])?,
                    true,
                ),
            ];
            for r in 0..w {
                let fp = FlatParameter::new(&params, r, w)?;
                let c = fp.shard_numel();
                let (lo, hi) = ((c * r).min(n), (c * (r + 1)).min(n));
                let got = b.pad_copy(&all[lo..hi], c)?;
                assert_bits("pad_copy", b, &got, &fp.local_shard().to_vec_f32()?);
            }
        }
    }
    Ok(())
});

backend_test!(flatten_and_unflatten_round_trip, |b| {
    let lens = [0usize, 1, 7, 3, 257, 0, 2];
    let parts: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| values(i as u64, l))
        .collect();
    let total: usize = lens.iter().sum();
    let init = vec![9.0f32; total + 5];
    let flat = b.flatten(&parts, &init)?;
    let mut want: Vec<f32> = parts.concat();
    want.extend([9.0; 5]);
    assert_bits("flatten", b, &flat, &want);
    let back = b.unflatten(&flat, &lens)?;
    for (g, w) in back.iter().zip(&parts) {
        assert_bits("unflatten", b, g, w);
    }
    assert!(
        b.unflatten(&flat[..3], &lens).is_err(),
        "short source accepted"
    );
    Ok(())
});

fn cast_case<S: Element, T: Element>(b: &Backend, x: &[f32]) -> Result<()> {
    let src: Vec<S> = to(x);
    let want = Tensor::from_vec(src.clone(), &[src.len()])?.to_dtype(T::DTYPE)?;
    let got: Vec<T> = b.cast(&src)?;
    assert_bits(
        &format!("cast {} -> {}", S::DTYPE, T::DTYPE),
        b,
        &got,
        &want.data::<T>()?,
    );
    Ok(())
}

backend_test!(casts_round_like_tensor_to_dtype, |b| {
    for &n in SIZES {
        let x = tricky(n, 2);
        cast_case::<f32, bf16>(b, &x)?;
        cast_case::<f32, f16>(b, &x)?;
        cast_case::<bf16, f32>(b, &x)?;
        cast_case::<f16, f32>(b, &x)?;
        cast_case::<bf16, f16>(b, &x)?;
        cast_case::<f16, bf16>(b, &x)?;
    }
    Ok(())
});

fn grad_case<T: Element>(b: &Backend, g: &[f32], pre: f32, post: f32) -> Result<()> {
    // The runtime's predivide: scale_ then to_dtype.
    let t = Tensor::from_vec(g.to_vec(), &[g.len()])?;
    fsdp::backend::cpu::ops::scale_(&mut t.f32_mut()?, 1.0 / pre);
    let want = t.to_dtype(T::DTYPE)?;
    let packed: Vec<T> = b.pack_grad(g, 1.0 / pre)?;
    assert_bits(
        &format!("pack_grad {}", T::DTYPE),
        b,
        &packed,
        &want.data::<T>()?,
    );
    // Postdivide in the reduce dtype, then upcast: to f32, scale, round to T, to f32.
    let up = want.to_dtype(DType::F32)?;
    fsdp::backend::cpu::ops::scale_(&mut up.f32_mut()?, 1.0 / post);
    let want = up.to_dtype(T::DTYPE)?.to_dtype(DType::F32)?;
    let got = b.unpack_grad(&packed, 1.0 / post)?;
    assert_bits(
        &format!("unpack_grad {}", T::DTYPE),
        b,
        &got,
        &want.to_vec_f32()?,
    );
    // sum_into: one rounding per addition.
    let y: Vec<T> = to(&values(9, g.len()));
    let want: Vec<T> = packed
        .iter()
        .zip(&y)
        .map(|(a, c)| T::from_f32(a.to_f32() + c.to_f32()))
        .collect();
    assert_bits(
        &format!("sum_into {}", T::DTYPE),
        b,
        &b.sum_into(&packed, &y)?,
        &want,
    );
    Ok(())
}

backend_test!(pack_unpack_and_sum_match_the_runtime_reduction, |b| {
    for &n in SIZES {
        let g = tricky(n, 3);
        for (pre, post) in [(1.0, 1.0), (2.0, 3.0), (4.0, 1.5)] {
            grad_case::<f32>(b, &g, pre, post)?;
            grad_case::<bf16>(b, &g, pre, post)?;
            grad_case::<f16>(b, &g, pre, post)?;
        }
    }
    Ok(())
});

backend_test!(vector_kernels_agree_at_every_alignment, |b| {
    // Element offsets 1..8 put f32, 16-bit and i32 pointers at every 16-byte misalignment;
    // sizes around the vector widths (4 and 8 elements) exercise the scalar tails.
    for shift in 0..8 {
        backend::with_shift(shift, || -> Result<()> {
            for n in [0usize, 1, 3, 4, 5, 8, 9, 17, 33, 257] {
                let x = tricky(n, 4 + shift as u64);
                assert_bits("copy f32", b, &b.copy(&x)?, &x);
                assert_bits("copy bf16", b, &b.copy(&to::<bf16>(&x))?, &to::<bf16>(&x));
                cast_case::<f32, bf16>(b, &x)?;
                cast_case::<bf16, f32>(b, &x)?;
                cast_case::<f16, bf16>(b, &x)?;
                grad_case::<f32>(b, &x, 2.0, 3.0)?;
                grad_case::<bf16>(b, &x, 2.0, 3.0)?;
                for extra in [0usize, 1, 6] {
                    let mut want = x.clone();
                    want.resize(n + extra, 0.0);
                    assert_bits("pad_copy f32", b, &b.pad_copy(&x, n + extra)?, &want);
                    let (xh, wh) = (to::<f16>(&x), to::<f16>(&want));
                    assert_bits("pad_copy f16", b, &b.pad_copy(&xh, n + extra)?, &wh);
                }
            }
            let lens = [5usize, 8, 1, 13, 0, 4];
            let parts: Vec<Vec<f32>> = lens.iter().map(|&l| tricky(l, l as u64)).collect();
            let total: usize = lens.iter().sum();
            let flat = b.flatten(&parts, &vec![7.0; total])?;
            assert_bits("flatten", b, &flat, &parts.concat());
            for (g, w) in b.unflatten(&flat, &lens)?.iter().zip(&parts) {
                assert_bits("unflatten", b, g, w);
            }
            Ok(())
        })?;
    }
    Ok(())
});

backend_test!(gelu_matches_the_module_bitwise, |b| {
    for &n in SIZES {
        let x: Vec<f32> = values(4, n).iter().map(|v| v * 6.0).collect();
        let dy = values(5, n);
        let mut m = fsdp::nn::GELU::new();
        let cx = Context::train();
        let y = m.forward(&Tensor::from_vec(x.clone(), &[n])?, &cx)?;
        let dx = m.backward(&Tensor::from_vec(dy.clone(), &[n])?, &cx)?;
        assert_bits("gelu_fwd", b, &b.gelu_fwd(&x)?, &y.to_vec_f32()?);
        assert_bits("gelu_bwd", b, &b.gelu_bwd(&x, &dy)?, &dx.to_vec_f32()?);
    }
    Ok(())
});

backend_test!(bias_add_and_grad, |b| {
    for (rows, c) in [(0usize, 3usize), (1, 1), (7, 13), (33, 5), (300, 17)] {
        let (y, bias, db0) = (values(6, rows * c), values(7, c), values(8, c));
        let (got_y, got_db) = b.bias(&y, &bias, &db0)?;
        let want_y: Vec<f32> = y.iter().enumerate().map(|(i, v)| v + bias[i % c]).collect();
        let want_db: Vec<f32> = (0..c)
            .map(|j| db0[j] + (0..rows).fold(0.0f32, |a, r| a + y[r * c + j]))
            .collect();
        assert_bits("bias_add", b, &got_y, &want_y);
        if b.name() == "cpu" {
            // The CPU reference sums rows in order.
            assert_bits("bias_grad", b, &got_db, &want_db);
        } else {
            // The GPU's column sums add 32 strided partial sums (nn.cu, column_sums): within
            // f32 rounding of the f64 sum, and the same bits on every run.
            for j in 0..c {
                let exact: f64 =
                    db0[j] as f64 + (0..rows).map(|r| y[r * c + j] as f64).sum::<f64>();
                let mag: f64 =
                    db0[j].abs() as f64 + (0..rows).map(|r| y[r * c + j].abs() as f64).sum::<f64>();
                let err = (got_db[j] as f64 - exact).abs();
                assert!(
                    err <= 1e-6 * mag + 1e-30,
                    "bias_grad[{j}] {rows}x{c}: {} vs {exact}",
                    got_db[j]
                );
            }
            let (_, again) = b.bias(&y, &bias, &db0)?;
            assert_bits("bias_grad (rerun)", b, &again, &got_db);
        }
    }
    Ok(())
});
