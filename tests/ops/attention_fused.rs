//! The CPU's per-head attention (`backend::cpu::attention`) gives the bits of the op-by-op
//! path it replaces in `nn::CausalSelfAttention` ([Note: per-head attention, same bits]):
//! split q, k, v, causal products, causal softmax, merged heads, and backward, for shapes
//! where the causal products run blocked and where they do not, at 1 and 2 threads.

use fsdp::backend::cpu::attention;
use fsdp::backend::cpu::parallel::with_num_threads;
use fsdp::ops::{self, CausalProduct, HeadDims};
use fsdp::tensor::Tensor;

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// (y, p, dqkv) of the op-by-op path (the code of `nn::CausalSelfAttention` before the
/// per-head path).
fn reference(qkv: &Tensor, dy: &Tensor, d: HeadDims, scale: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dev = qkv.device();
    let (b, t, h, hd) = (d.b, d.t, d.h, d.hd);
    let [q, k, v] = ops::split_qkv(qkv, d).unwrap();
    let scores = Tensor::zeros_on(&[b, h, t, t], fsdp::tensor::DType::F32, dev).unwrap();
    ops::causal_matmul(&scores, &q, &k, CausalProduct::Scores, d).unwrap();
    let p = ops::softmax_causal(&scores, t, scale).unwrap();
    let yh = Tensor::zeros_on(&[b, h, t, hd], fsdp::tensor::DType::F32, dev).unwrap();
    ops::causal_matmul(&yh, &p, &v, CausalProduct::Lower, d).unwrap();
    let y = ops::merge_heads(&yh, d).unwrap();
    let dyh = ops::split_heads(dy, d).unwrap();
    let z = |s: &[usize]| Tensor::zeros_on(s, fsdp::tensor::DType::F32, dev).unwrap();
    let dp = z(&[b, h, t, t]);
    ops::causal_matmul(&dp, &dyh, &v, CausalProduct::Scores, d).unwrap();
    let dv = z(&[b, h, t, hd]);
    ops::causal_matmul(&dv, &p, &dyh, CausalProduct::LowerT, d).unwrap();
    ops::softmax_causal_backward_(&p, &dp, t, scale).unwrap();
    let dq = z(&[b, h, t, hd]);
    ops::causal_matmul(&dq, &dp, &k, CausalProduct::Lower, d).unwrap();
    let dk = z(&[b, h, t, hd]);
    ops::causal_matmul(&dk, &dp, &q, CausalProduct::LowerT, d).unwrap();
    let dqkv = ops::merge_qkv(&dq, &dk, &dv, d).unwrap();
    (
        y.to_vec_f32().unwrap(),
        p.to_vec_f32().unwrap(),
        dqkv.to_vec_f32().unwrap(),
    )
}

#[test]
fn per_head_attention_has_the_op_by_op_bits() {
    // (B, T, H, hd): blocked LowerT (T in 64..=512, hd >= 16), T = 128 as the large config,
    // a T that is not a multiple of the block or of 16, and small heads (full products).
    for (b, t, h, hd) in [
        (2, 128, 2, 32),
        (3, 64, 2, 16),
        (2, 80, 3, 16),
        (2, 100, 2, 24),
        (3, 16, 2, 8),
        (1, 7, 3, 4),
    ] {
        let d = HeadDims { b, t, h, hd };
        let c = h * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let qkv = Tensor::from_vec(data(b * t * 3 * c, 1), &[b, t, 3 * c]).unwrap();
        let dy = Tensor::from_vec(data(b * t * c, 2), &[b, t, c]).unwrap();
        let (y0, p0, dx0) = reference(&qkv, &dy, d, scale);
        for threads in [1, 2] {
            let (mut y, mut p, mut dx) = (
                vec![f32::NAN; b * t * c],
                vec![f32::NAN; b * h * t * t],
                vec![f32::NAN; b * t * 3 * c],
            );
            with_num_threads(threads, || {
                let (qv, gv) = (qkv.to_vec_f32().unwrap(), dy.to_vec_f32().unwrap());
                attention::forward(&qv, &mut y, &mut p, d, scale).unwrap();
                attention::backward(&qv, &p, &gv, &mut dx, d, scale).unwrap();
            });
            let shape = format!("B {b} T {t} H {h} hd {hd}, {threads} threads");
            assert_eq!(bits(&y), bits(&y0), "y, {shape}");
            assert_eq!(bits(&p), bits(&p0), "p, {shape}");
            assert_eq!(bits(&dx), bits(&dx0), "dqkv, {shape}");
        }
    }
}

#[test]
fn wrong_lengths_are_errors() {
    let d = HeadDims {
        b: 1,
        t: 4,
        h: 2,
        hd: 2,
    };
    let (mut y, mut p) = (vec![0.0; 16], vec![0.0; 32]);
    let err = attention::forward(&[0.0; 47], &mut y, &mut p, d, 1.0).unwrap_err();
    assert!(err.to_string().contains("attention forward"), "{err}");
    let mut dx = vec![0.0; 48];
    let err = attention::backward(&[0.0; 48], &p, &[0.0; 15], &mut dx, d, 1.0).unwrap_err();
    assert!(err.to_string().contains("attention backward"), "{err}");
}
