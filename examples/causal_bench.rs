//! Times attention's per-head products at `T = 128` (or `$T`), `hd = 32`, 8 heads, one
//! thread: the full batched GEMM (`matmul_batched`) against `causal_matmul` (blocked where
//! that pays, see `fsdp::ops::causal`). Thread CPU time, so a loaded machine disturbs it less.
//!
//! `cargo run --release --example causal_bench`
use fsdp::ops::{causal_matmul, matmul_batched, CausalProduct, HeadDims, MatmulDims, Transpose};
use fsdp::tensor::Tensor;

fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn filled(n: usize) -> Tensor {
    let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    Tensor::from_vec(v, &[n]).expect("a vector of n elements")
}

/// Mean thread CPU milliseconds of `f` over 20 runs after 3 untimed ones.
fn time(mut f: impl FnMut()) -> f64 {
    (0..3).for_each(|_| f());
    let c0 = thread_cpu();
    (0..20).for_each(|_| f());
    (thread_cpu() - c0) * 1e3 / 20.0
}

fn main() -> fsdp::Result<()> {
    let t: usize = std::env::var("T")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    let d = HeadDims {
        b: (4096 / t).max(1),
        t,
        h: 8,
        hd: 32,
    };
    let bh = d.b * d.h;
    let (q, p) = (filled(bh * t * d.hd), filled(bh * t * t));
    let (s, o) = (filled(bh * t * t), filled(bh * t * d.hd));
    println!(
        "{bh} heads, T {t}, hd {}: ms per call (full / causal_matmul)",
        d.hd
    );
    for (which, a, out, dims) in [
        (
            CausalProduct::Scores,
            &q,
            &s,
            MatmulDims::new(t, d.hd, t, Transpose::NT),
        ),
        (
            CausalProduct::Lower,
            &p,
            &o,
            MatmulDims::new(t, t, d.hd, Transpose::NN),
        ),
        (
            CausalProduct::LowerT,
            &p,
            &o,
            MatmulDims::new(t, t, d.hd, Transpose::TN),
        ),
    ] {
        let full = time(|| matmul_batched(out, a, &q, dims, bh, false).expect("full"));
        let causal = time(|| causal_matmul(out, a, &q, which, d).expect("causal"));
        println!("{which:?}: {full:.2} / {causal:.2}");
    }
    Ok(())
}
