//! Finite-difference checks of the f64 ops the GPT layers use: GELU, LayerNorm (input,
//! weight, bias), causal self-attention (input and every projection), cross-entropy and
//! embedding. Each backward is compared with central differences of an f64 objective
//! `L = sum r * f(x)` (a fixed `r`), to 1e-8 relative: f32 arithmetic anywhere on the way
//! would miss by about 1e-4.

use fsdp::nn::{self, CausalSelfAttention, Context, InitKey, Module};
use fsdp::ops::{self, Pointwise};
use fsdp::tensor::{DType, Tensor};

/// `n` values spread over about `[-scale, scale]`, with bits beyond f32's.
fn wave(n: usize, k: f64, scale: f64) -> Vec<f64> {
    (0..n)
        .map(|i| scale * (0.7548776662466927 * i as f64 + k).sin() * (1.0 + 1e-9 * i as f64))
        .collect()
}

fn t64(v: Vec<f64>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape).unwrap()
}

fn dot(a: &Tensor, r: &[f64]) -> f64 {
    a.to_vec_f64()
        .unwrap()
        .iter()
        .zip(r)
        .map(|(a, b)| a * b)
        .sum()
}

/// Central differences of `f` at `x`, entry by entry, against `grad`.
fn check(what: &str, x: &[f64], grad: &[f64], f: impl Fn(&[f64]) -> f64) {
    assert_eq!(x.len(), grad.len(), "{what}");
    let h = 1e-6;
    let mut worst = 0.0f64;
    for i in 0..x.len() {
        let mut v = x.to_vec();
        v[i] += h;
        let lp = f(&v);
        v[i] -= 2.0 * h;
        let lm = f(&v);
        let num = (lp - lm) / (2.0 * h);
        let e = (num - grad[i]).abs() / (1.0 + num.abs());
        worst = worst.max(e);
        assert!(
            e <= 1e-8,
            "{what}[{i}]: backward {} vs finite difference {num}",
            grad[i]
        );
    }
    println!("{what}: worst relative error {worst:e}");
}

#[test]
fn gelu_f64_backward_matches_finite_differences() {
    let n = 40;
    let x = wave(n, 0.3, 4.0);
    let r = wave(n, 1.7, 1.0);
    let xt = t64(x.clone(), &[n]);
    let y = ops::pointwise(Pointwise::Gelu, &xt).unwrap();
    assert_eq!(y.dtype(), DType::F64);
    // Known values: gelu(x) = x Phi(x).
    let y1 = ops::pointwise(Pointwise::Gelu, &t64(vec![1.0, -2.0, 0.0], &[3])).unwrap();
    let want = [0.8413447460685429, -0.04550026389635842, 0.0];
    for (g, w) in y1.to_vec_f64().unwrap().iter().zip(want) {
        assert!((g - w).abs() <= 1e-15, "gelu {g} vs {w}");
    }
    let dx = ops::pointwise_backward(Pointwise::Gelu, &xt, &t64(r.clone(), &[n])).unwrap();
    check("GELU dx", &x, &dx.to_vec_f64().unwrap(), |v| {
        dot(
            &ops::pointwise(Pointwise::Gelu, &t64(v.to_vec(), &[n])).unwrap(),
            &r,
        )
    });
}

#[test]
fn layer_norm_f64_backward_matches_finite_differences() {
    let (rows, c) = (3, 7);
    let x = wave(rows * c, 0.1, 2.0);
    let w = wave(c, 2.2, 1.5);
    let b = wave(c, 0.9, 0.5);
    let r = wave(rows * c, 3.1, 1.0);
    let loss = |x: &[f64], w: &[f64], b: &[f64]| {
        let (y, _) = ops::layer_norm(
            &t64(x.to_vec(), &[rows, c]),
            &t64(w.to_vec(), &[c]),
            &t64(b.to_vec(), &[c]),
            1e-5,
        )
        .unwrap();
        dot(&y, &r)
    };
    let (y, saved) = ops::layer_norm(
        &t64(x.clone(), &[rows, c]),
        &t64(w.clone(), &[c]),
        &t64(b.clone(), &[c]),
        1e-5,
    )
    .unwrap();
    assert_eq!(y.dtype(), DType::F64);
    let (dw, db) = (
        Tensor::zeros(&[c], DType::F64),
        Tensor::zeros(&[c], DType::F64),
    );
    let dx = ops::layer_norm_backward(
        &t64(r.clone(), &[rows, c]),
        &saved,
        &t64(w.clone(), &[c]),
        Some(&dw),
        Some(&db),
    )
    .unwrap();
    check("LayerNorm dx", &x, &dx.to_vec_f64().unwrap(), |v| {
        loss(v, &w, &b)
    });
    check("LayerNorm dw", &w, &dw.to_vec_f64().unwrap(), |v| {
        loss(&x, v, &b)
    });
    check("LayerNorm db", &b, &db.to_vec_f64().unwrap(), |v| {
        loss(&x, &w, v)
    });
}

/// Causal self-attention `(B, T, C) = (2, 4, 8)`, 2 heads, in f64.
fn attention() -> CausalSelfAttention {
    let mut a = CausalSelfAttention::new(8, 2, &InitKey::new(4)).unwrap();
    nn::module_to_dtype(&mut a, DType::F64).unwrap();
    // Larger weights than the init's 0.02, so the softmax is far from uniform.
    nn::visit_parameters(&mut a, "", false, &mut |n, p| {
        let k = n.len() as f64;
        let v = wave(p.numel(), k, 0.6);
        p.data()?.data_mut::<f64>()?.copy_from_slice(&v);
        Ok(())
    })
    .unwrap();
    a
}

#[test]
fn attention_f64_backward_matches_finite_differences() {
    let shape = [2, 4, 8];
    let n: usize = shape.iter().product();
    let x = wave(n, 0.5, 1.5);
    let r = wave(n, 2.5, 1.0);
    let mut a = attention();
    let y = a
        .forward(&t64(x.clone(), &shape), &Context::train())
        .unwrap();
    assert_eq!(y.dtype(), DType::F64);
    let dx = a
        .backward(&t64(r.clone(), &shape), &Context::train())
        .unwrap();
    check("attention dx", &x, &dx.to_vec_f64().unwrap(), |v| {
        let y = attention()
            .forward(&t64(v.to_vec(), &shape), &Context::eval())
            .unwrap();
        dot(&y, &r)
    });
    let mut grads = Vec::new();
    nn::visit_parameters(&mut a, "", false, &mut |name, p| {
        grads.push((
            name.to_string(),
            p.data()?.to_vec_f64()?,
            p.grad().unwrap().to_vec_f64()?,
        ));
        Ok(())
    })
    .unwrap();
    assert_eq!(grads.len(), 4);
    for (name, p0, g) in &grads {
        check(&format!("attention d{name}"), p0, g, |v| {
            let mut m = attention();
            nn::visit_parameters(&mut m, "", false, &mut |pn, p| {
                if pn == name {
                    p.data()?.data_mut::<f64>()?.copy_from_slice(v);
                }
                Ok(())
            })
            .unwrap();
            let y = m
                .forward(&t64(x.clone(), &shape), &Context::eval())
                .unwrap();
            dot(&y, &r)
        });
    }
}

#[test]
fn cross_entropy_f64_gradient_matches_finite_differences() {
    let (n, v) = (5, 6);
    let logits = wave(n * v, 0.2, 3.0);
    let targets = Tensor::from_vec(vec![0i32, 5, 2, 2, 3], &[n]).unwrap();
    let (l, g) = ops::cross_entropy_f64(&t64(logits.clone(), &[n, v]), &targets).unwrap();
    // The f32 API rounds the same loss.
    let (l32, g32) = ops::cross_entropy(&t64(logits.clone(), &[n, v]), &targets).unwrap();
    assert_eq!(l32, l as f32);
    assert_eq!(g32.to_vec_f64().unwrap(), g.to_vec_f64().unwrap());
    // Known value: uniform logits give ln V.
    let (lu, _) = ops::cross_entropy_f64(&t64(vec![0.25; n * v], &[n, v]), &targets).unwrap();
    assert!((lu - (v as f64).ln()).abs() <= 1e-15, "{lu}");
    check(
        "cross_entropy dlogits",
        &logits,
        &g.to_vec_f64().unwrap(),
        |x| {
            ops::cross_entropy_f64(&t64(x.to_vec(), &[n, v]), &targets)
                .unwrap()
                .0
        },
    );
}

#[test]
fn embedding_f64_backward_matches_finite_differences() {
    let (vocab, c) = (5, 3);
    let table = wave(vocab * c, 0.4, 1.0);
    // Repeated ids add up; id 4 is never used (zero gradient).
    let ids = Tensor::from_vec(vec![1i32, 3, 1, 0, 2, 1], &[2, 3]).unwrap();
    let r = wave(6 * c, 1.9, 1.0);
    let out = ops::embedding(&t64(table.clone(), &[vocab, c]), &ids).unwrap();
    assert_eq!(out.shape(), [2, 3, c]);
    assert_eq!(out.to_vec_f64().unwrap()[..c], table[c..2 * c]);
    let grad = Tensor::zeros(&[vocab, c], DType::F64);
    ops::embedding_backward(&ids, &t64(r.clone(), &[2, 3, c]), &grad).unwrap();
    let g = grad.to_vec_f64().unwrap();
    assert!(g[4 * c..].iter().all(|&v| v == 0.0));
    check("embedding dtable", &table, &g, |t| {
        dot(
            &ops::embedding(&t64(t.to_vec(), &[vocab, c]), &ids).unwrap(),
            &r,
        )
    });
    let bad = Tensor::from_vec(vec![5i32], &[1]).unwrap();
    let e = ops::embedding(&t64(table.clone(), &[vocab, c]), &bad).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
}
