//! Bandwidth of the copy/cast/pack kernels against a plain device copy kernel
//! (`copy_f32`) measured in the same run, at 64 MiB and 256 MiB of f32 input (issue 5's
//! target: each >= 0.9 of the copy's bytes/s at >= 64 MiB). Bytes counted: every input
//! element read once plus every output element written once. Every timed iteration ends
//! with a stream synchronize, so criterion's clock covers the kernel.
//!
//! Then an event-timed table (median of 20 launches after 3 warm-ups) of GB/s and the
//! ratio to the copy, the lines `scripts/gpu-check.sh` puts in its summary.
//!
//! `cargo bench --features cuda --bench kernels`; without a GPU it prints a skip notice.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fsdp::backend::cuda::{self as cu, CudaDevice, DeviceTensor, MemAccount, Stream};
use fsdp::tensor::DType;
use std::time::Duration;

type Op = Box<dyn Fn(&Stream) -> fsdp::Result<()>>;

struct Case {
    name: &'static str,
    bytes: usize,
    op: Op,
}

fn cases(s: &Stream, mib: usize) -> fsdp::Result<Vec<Case>> {
    let n = mib << 18; // f32 elements in `mib` MiB
    let f32a = DeviceTensor::zeros(s, &[n], DType::F32)?;
    let f32b = DeviceTensor::zeros(s, &[n], DType::F32)?;
    let bf = DeviceTensor::zeros(s, &[n], DType::BF16)?;
    let bf2 = DeviceTensor::zeros(s, &[n], DType::BF16)?;
    let mk = |name, bytes, op: Op| Case { name, bytes, op };
    let (a, b) = (f32a.clone(), f32b.clone());
    let mut v = vec![mk(
        "copy_f32",
        8 * n,
        Box::new(move |s: &Stream| cu::copy(s, &a, &b)),
    )];
    let (a, o) = (f32a.clone(), bf.clone());
    v.push(mk(
        "cast_f32_bf16",
        6 * n,
        Box::new(move |s: &Stream| cu::cast(s, &a, &o)),
    ));
    let (i, b) = (bf.clone(), f32b.clone());
    v.push(mk(
        "cast_bf16_f32",
        6 * n,
        Box::new(move |s: &Stream| cu::cast(s, &i, &b)),
    ));
    let (a, o) = (f32a.clone(), bf.clone());
    v.push(mk(
        "pack_grad_bf16",
        6 * n,
        Box::new(move |s: &Stream| cu::pack_grad(s, &a, &o, 0.5)),
    ));
    let (a, b) = (f32a.clone(), f32b.clone());
    v.push(mk(
        "pack_grad_f32",
        8 * n,
        Box::new(move |s: &Stream| cu::pack_grad(s, &a, &b, 0.5)),
    ));
    let (a, b) = (f32a.view(0, &[n - 1000])?, f32b.clone());
    v.push(mk(
        "pad_copy_f32",
        8 * n - 4000,
        Box::new(move |s: &Stream| cu::pad_copy(s, &a, &b)),
    ));
    let (x, y) = (bf2.clone(), bf.clone());
    v.push(mk(
        "sum_into_bf16",
        6 * n,
        Box::new(move |s: &Stream| cu::sum_into(s, &y, &x)),
    ));
    let parts: Vec<DeviceTensor> = (0..16)
        .map(|k| f32a.view(k * (n / 16), &[n / 16]))
        .collect::<fsdp::Result<_>>()?;
    let b = f32b.clone();
    v.push(mk(
        "flatten_f32 (16 parts)",
        8 * (n / 16) * 16,
        Box::new(move |s: &Stream| cu::flatten(s, &parts.iter().collect::<Vec<_>>(), &b)),
    ));
    Ok(v)
}

fn median_ms(s: &Stream, op: &Op) -> fsdp::Result<f64> {
    for _ in 0..3 {
        op(s)?;
    }
    let mut t = Vec::new();
    for _ in 0..20 {
        let e0 = s.record()?;
        op(s)?;
        let e1 = s.record()?;
        e1.synchronize()?;
        t.push(e0.elapsed_ms(&e1)? as f64);
    }
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[t.len() / 2])
}

fn bench(c: &mut Criterion) {
    let s = match CudaDevice::get(0).and_then(|d| Stream::new(&d, MemAccount::new())) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("skipping the kernel benchmarks: {e}");
            return;
        }
    };
    let mut table = Vec::new();
    for mib in [64usize, 256] {
        let cs = match cases(&s, mib) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("kernel benchmarks at {mib} MiB: {e}");
                return;
            }
        };
        let mut g = c.benchmark_group(format!("kernels_{mib}MiB"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(800));
        for case in &cs {
            g.throughput(Throughput::Bytes(case.bytes as u64));
            g.bench_function(case.name, |bch| {
                bch.iter(|| {
                    (case.op)(&s)
                        .and_then(|_| s.synchronize())
                        .expect("kernel failed");
                })
            });
        }
        g.finish();
        let copy_ms = median_ms(&s, &cs[0].op).unwrap_or(f64::NAN);
        let copy_gbs = cs[0].bytes as f64 / copy_ms / 1e6;
        for case in &cs {
            match median_ms(&s, &case.op) {
                Ok(ms) => {
                    let gbs = case.bytes as f64 / ms / 1e6;
                    table.push(format!(
                        "BW {mib:>4} MiB  {:<24} {ms:8.3} ms  {gbs:8.1} GB/s  {:5.2} of copy",
                        case.name,
                        gbs / copy_gbs
                    ));
                }
                Err(e) => table.push(format!("BW {mib:>4} MiB  {:<24} failed: {e}", case.name)),
            }
        }
    }
    println!("\nkernel bandwidth (bytes read + written per second; median of 20, event-timed):");
    for l in table {
        println!("{l}");
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
