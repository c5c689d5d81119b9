//! GEMM on the main job's shapes: the `gemm` crate (what [`fsdp::backend::cpu::gemm`]
//! runs) on 1 and 2 threads against `matrixmultiply` on 1 thread. Throughput is printed
//! as elements/s where one element is one flop: read `Gelem/s` as GFLOP/s.
//!
//! `cargo bench --bench gemm`. Shapes (m, k, n) of the default GPT (4 layers x 128, 64 x 64
//! tokens): the projections `[4096x128]x[128x384]`, `[4096x128]x[128x512]`,
//! `[4096x512]x[512x128]` and their backward transposes; and the 256-wide configuration.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fsdp::backend::cpu::gemm::{matmul, Transpose};
use fsdp::backend::cpu::parallel::with_num_threads;
use std::time::Duration;

/// (name, m, k, n, transposes as stored).
const SHAPES: &[(&str, usize, usize, usize, Transpose)] = &[
    ("qkv_fwd_4096x128x384", 4096, 128, 384, Transpose::NT),
    ("fc_fwd_4096x128x512", 4096, 128, 512, Transpose::NT),
    ("proj_fwd_4096x512x128", 4096, 512, 128, Transpose::NT),
    ("fc_dx_4096x512x128", 4096, 512, 128, Transpose::NN),
    ("fc_dw_512x4096x128", 512, 4096, 128, Transpose::TN),
    ("proj_dw_128x4096x512", 128, 4096, 512, Transpose::TN),
    ("wide_fc_fwd_8192x256x1024", 8192, 256, 1024, Transpose::NT),
    ("wide_fc_dw_1024x8192x256", 1024, 8192, 256, Transpose::TN),
    ("attn_scores_64x32x64", 64, 32, 64, Transpose::NT),
];

fn mm_matrixmultiply(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    t: Transpose,
) {
    let (rsa, csa) = if t.a {
        (1, m as isize)
    } else {
        (k as isize, 1)
    };
    let (rsb, csb) = if t.b {
        (1, k as isize)
    } else {
        (n as isize, 1)
    };
    // SAFETY: the strides describe the row-major layouts of a (m x k or k x m), b (k x n or
    // n x k) and out (m x n) inside their lengths, and out overlaps neither input.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            0.0,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

fn bench_gemm(c: &mut Criterion) {
    let mut group = c.benchmark_group("gemm");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    for &(name, m, k, n, t) in SHAPES {
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 37) % 101) as f32 * 0.01).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 53) % 97) as f32 * 0.01).collect();
        let mut out = vec![0.0f32; m * n];
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        for threads in [1, 2] {
            group.bench_function(format!("{name}/gemm_crate_{threads}t"), |bch| {
                bch.iter(|| {
                    with_num_threads(threads, || matmul(&mut out, &a, &b, m, k, n, t, false))
                        .unwrap()
                })
            });
        }
        group.bench_function(format!("{name}/matrixmultiply_1t"), |bch| {
            bch.iter(|| mm_matrixmultiply(&mut out, &a, &b, m, k, n, t))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_gemm);
criterion_main!(benches);
