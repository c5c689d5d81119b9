//! The threads process group and FSDP on CUDA tensors, against the CPU: every collective
//! bit for bit (several ranks sharing cuda:0, and across GPUs when there are several),
//! the communication stream's ordering, FSDP FullShard / ShardGradOp / HybridShard (and
//! CPU offload) at world sizes 1, 2, 4 against unsharded CPU training, mixed precision,
//! `clip_grad_norm_`, state dicts and checkpoints through the host, `fsdp train` on CUDA,
//! and the clear errors of mixed-device collectives.
//!
//! Every test ends in `_cuda` (scripts/gpu-check.sh selects them by that) and prints
//! "skipping <test> on CUDA: <why>" and passes without a usable GPU.

use crate::common;

use common::{assert_close, values};
use fsdp::backend::Device;
use fsdp::distributed::{launch, CommStream, Group, LaunchOptions, ReduceOp};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, CpuOffload, FsdpConfig, FullStateDictConfig,
    FullyShardedDataParallel, MixedPrecision, ShardingStrategy, StateDict, StateDictConfig,
};
use fsdp::nn::{loss, visit_parameters, Context, GptConfig, Module, GPT};
use fsdp::optim::Optimizer;
use fsdp::tensor::{DType, Tensor};

const CUDA0: Device = Device::Cuda(0);

/// The number of GPUs, or `None` after printing why `test` is skipped.
fn gpus(test: &str) -> Option<usize> {
    match fsdp::backend::cuda::detect() {
        Ok(d) => Some(d.len()),
        Err(e) => {
            eprintln!("skipping {test} on CUDA: {e}");
            None
        }
    }
}

fn bytes(t: &Tensor) -> Vec<u8> {
    let h = t.to_device(Device::Cpu).unwrap();
    match h.dtype() {
        DType::F32 => bytemuck::cast_slice(&h.data::<f32>().unwrap()).to_vec(),
        DType::BF16 => bytemuck::cast_slice(&h.data::<half::bf16>().unwrap()).to_vec(),
        DType::F16 => bytemuck::cast_slice(&h.data::<half::f16>().unwrap()).to_vec(),
        DType::I32 => bytemuck::cast_slice(&h.data::<i32>().unwrap()).to_vec(),
        DType::F64 => bytemuck::cast_slice(&h.data::<f64>().unwrap()).to_vec(),
        DType::I64 => bytemuck::cast_slice(&h.data::<i64>().unwrap()).to_vec(),
    }
}

/// `n` values of `dtype` on `dev`: spread floats (many binades after reduction; f64 ones
/// with bits beyond f32's), or integers up to +-1000 (a product over 4 ranks saturates
/// i32).
fn input(dtype: DType, seed: u64, n: usize, dev: Device) -> fsdp::Result<Tensor> {
    let v: Vec<f32> = values(seed, n)
        .iter()
        .enumerate()
        .map(|(i, x)| match dtype {
            DType::I32 => (x * 1000.0).round(),
            _ => x * (1u32 << (i % 9)) as f32 / 16.0,
        })
        .collect();
    if dtype == DType::F64 {
        let v: Vec<f64> = v
            .iter()
            .enumerate()
            .map(|(i, &x)| f64::from(x) * (1.0 + 1e-10 * i as f64))
            .collect();
        return Tensor::from_vec(v, &[n])?.to_device(dev);
    }
    Tensor::from_vec(v, &[n])?.to_dtype(dtype)?.to_device(dev)
}

#[derive(Clone, Copy, Debug)]
enum Coll {
    AllGather,
    AllGatherInPlace,
    ReduceScatter(ReduceOp),
    ReduceScatterInPlace(ReduceOp),
    AllReduce(ReduceOp),
    Broadcast(usize),
}

fn colls(world: usize) -> Vec<Coll> {
    use ReduceOp::*;
    let mut v = vec![Coll::AllGather, Coll::AllGatherInPlace];
    for op in [Sum, Avg] {
        v.push(Coll::ReduceScatter(op));
        v.push(Coll::ReduceScatterInPlace(op));
    }
    for op in [Sum, Avg, Max, Min, Product] {
        v.push(Coll::AllReduce(op));
    }
    v.push(Coll::Broadcast(0));
    v.push(Coll::Broadcast(world - 1));
    v
}

/// Every rank's result of `coll` (the whole buffer it wrote) with rank `r` on `place(r)`.
fn run_coll(
    coll: Coll,
    world: usize,
    dtype: DType,
    n: usize,
    place: &(dyn Fn(usize) -> Device + Sync),
) -> Vec<Vec<u8>> {
    launch(&LaunchOptions::new(world), |pg: Group| {
        let (r, w) = (pg.rank(), pg.size());
        let dev = place(r);
        let seed = 1000 * r as u64 + n as u64;
        let out = match coll {
            Coll::AllGather => {
                let (x, o) = (
                    input(dtype, seed, n, dev)?,
                    Tensor::zeros_on(&[w * n], dtype, dev)?,
                );
                pg.all_gather_into_tensor(&o, &x)?;
                o
            }
            Coll::AllGatherInPlace => {
                let o = input(dtype, seed + 7, w * n, dev)?;
                o.view(r * n, &[n])?
                    .copy_from(&input(dtype, seed, n, dev)?)?;
                pg.all_gather_into_tensor(&o, &o.view(r * n, &[n])?)?;
                o
            }
            Coll::ReduceScatter(op) => {
                let (x, o) = (
                    input(dtype, seed, w * n, dev)?,
                    Tensor::zeros_on(&[n], dtype, dev)?,
                );
                pg.reduce_scatter_tensor(&o, &x, op)?;
                o
            }
            Coll::ReduceScatterInPlace(op) => {
                let x = input(dtype, seed, w * n, dev)?;
                pg.reduce_scatter_tensor(&x.view(r * n, &[n])?, &x, op)?;
                x
            }
            Coll::AllReduce(op) => {
                let t = input(dtype, seed, n, dev)?;
                pg.all_reduce(&t, op)?;
                t
            }
            Coll::Broadcast(src) => {
                let t = input(dtype, seed, n, dev)?;
                pg.broadcast(&t, src)?;
                t
            }
        };
        Ok(bytes(&out))
    })
    .unwrap()
}

fn check_collectives(worlds: &[usize], sizes: &[usize], place: &(dyn Fn(usize) -> Device + Sync)) {
    for &w in worlds {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::I32, DType::F64] {
            for &n in sizes {
                for coll in colls(w) {
                    let want = run_coll(coll, w, dtype, n, &|_| Device::Cpu);
                    let got = run_coll(coll, w, dtype, n, place);
                    for (r, (g, x)) in got.iter().zip(&want).enumerate() {
                        assert!(g == x, "{coll:?} world {w} {dtype} n {n} rank {r}: CUDA result differs from the CPU's");
                    }
                }
            }
        }
    }
}

#[test]
fn collectives_on_one_gpu_match_the_cpu_bit_for_bit_cuda() {
    if gpus("collectives_on_one_gpu_match_the_cpu_bit_for_bit_cuda").is_none() {
        return;
    }
    check_collectives(&[1, 2, 3, 4], &[0, 1, 5, 33], &|_| CUDA0);
}

#[test]
fn collectives_across_gpus_match_the_cpu_bit_for_bit_cuda() {
    let Some(n) = gpus("collectives_across_gpus_match_the_cpu_bit_for_bit_cuda") else {
        return;
    };
    if n < 2 {
        eprintln!(
            "skipping collectives_across_gpus_match_the_cpu_bit_for_bit_cuda on CUDA: one GPU"
        );
        return;
    }
    check_collectives(&[2, 3, 4], &[1, 33], &move |r| Device::Cuda(r % n));
}

#[test]
fn comm_stream_orders_after_the_submitters_work_cuda() {
    if gpus("comm_stream_orders_after_the_submitters_work_cuda").is_none() {
        return;
    }
    launch(&LaunchOptions::new(2), |pg: Group| {
        let stream = CommStream::on_device("test-comm", CUDA0)?;
        // Big enough that the fill is still running when the job is submitted.
        let t = Tensor::zeros_on(&[1 << 22], DType::F32, CUDA0)?;
        fsdp::ops::fill_(&t, (pg.rank() + 1) as f32)?;
        stream.all_reduce(&pg, &t, ReduceOp::Sum).wait()?;
        // Visible to the compute stream right after the wait.
        fsdp::ops::scale_(&t, 2.0)?;
        let v = t.to_vec_f32()?;
        assert!(
            v.iter().all(|&x| x == 6.0),
            "rank {}: {:?}",
            pg.rank(),
            &v[..4]
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn work_wait_orders_the_waiters_stream_and_an_unordered_read_is_stale_cuda() {
    let Some(_) = gpus("work_wait_orders_the_waiters_stream_and_an_unordered_read_is_stale_cuda")
    else {
        return;
    };
    // The emulator defers stream work until something forces it; a GPU, or the emulator's
    // eager schedule, may have finished the job anyway, so only there is the stale read sure.
    // Other tests of this process force the device too (a free without the caching
    // allocator waits for all of it), so the check runs alone, in a child process.
    const CHILD: &str = "FSDP_TEST_STALE_READ_CHILD";
    let deferred = fsdp::backend::cuda::detect().unwrap()[0]
        .name
        .contains("cuda-emu")
        && std::env::var("CUDA_EMU_SCHEDULE").map_or(true, |v| v != "eager");
    let name = "work_wait_orders_the_waiters_stream_and_an_unordered_read_is_stale_cuda";
    if deferred && !common::run_alone(module_path!(), name, CHILD) {
        return;
    }
    launch(&LaunchOptions::new(1), |_pg: Group| {
        let stream = CommStream::on_device("test-comm", CUDA0)?;
        let t = Tensor::zeros_on(&[1 << 16], DType::F32, CUDA0)?;
        // With the wait: the compute stream's scale runs after the job's fill.
        let job_t = t.clone();
        let w = stream.submit_keeping(vec![t.clone()], move || fsdp::ops::fill_(&job_t, 7.0));
        w.wait()?;
        fsdp::ops::scale_(&t, 2.0)?;
        assert!(t.to_vec_f32()?.iter().all(|&x| x == 14.0));
        // Without it (the job is only known to be queued, on the host): the compute
        // stream's scale is not ordered after the fill, and under deferral it reads the
        // old values, so the result is not 2 x 9 everywhere.
        let job_t = t.clone();
        let w = stream.submit_keeping(vec![t.clone()], move || fsdp::ops::fill_(&job_t, 9.0));
        stream.synchronize();
        fsdp::ops::scale_(&t, 2.0)?;
        let v = t.to_vec_f32()?;
        if deferred {
            assert!(
                v.iter().any(|&x| x != 18.0),
                "the unordered read saw the fill"
            );
        }
        drop(w);
        Ok(())
    })
    .unwrap();
}

#[test]
fn threads_collectives_on_device_tensors_never_wait_on_the_host_cuda() {
    if gpus("threads_collectives_on_device_tensors_never_wait_on_the_host_cuda").is_none() {
        return;
    }
    use fsdp::backend::counters::host_syncs_on_this_thread;
    let out = launch(&LaunchOptions::new(2), |pg: Group| {
        let r = pg.rank() as f32;
        let t = Tensor::zeros_on(&[1000], DType::F32, CUDA0)?;
        fsdp::ops::fill_(&t, r + 1.0)?;
        let gathered = Tensor::zeros_on(&[2000], DType::F32, CUDA0)?;
        let shard = Tensor::zeros_on(&[1000], DType::F32, CUDA0)?;
        let before = host_syncs_on_this_thread();
        pg.all_reduce(&t, ReduceOp::Sum)?; // 3 everywhere
        pg.all_gather_into_tensor(&gathered, &t)?; // 3 x 2000
        pg.reduce_scatter_tensor(&shard, &gathered, ReduceOp::Sum)?; // 6 x 1000
        pg.all_reduce(&shard, ReduceOp::Sum)?; // 12 x 1000
        pg.broadcast(&t, 1)?;
        let waited = host_syncs_on_this_thread() - before;
        // The reads synchronize; the values show each collective saw the one before.
        Ok((waited, shard.to_vec_f32()?, t.to_vec_f32()?))
    })
    .unwrap();
    for (rank, (waited, shard, t)) in out.iter().enumerate() {
        assert_eq!(*waited, 0, "rank {rank} waited on the host");
        assert!(
            shard.iter().all(|&x| x == 12.0),
            "rank {rank}: {:?}",
            &shard[..4]
        );
        assert!(t.iter().all(|&x| x == 3.0), "rank {rank}: {:?}", &t[..4]);
    }
}

#[test]
fn mixed_device_collectives_are_clear_errors_cuda() {
    if gpus("mixed_device_collectives_are_clear_errors_cuda").is_none() {
        return;
    }
    // Ranks on different sides: every rank gets the mismatch, naming the CUDA one.
    let errs = launch(&LaunchOptions::new(2), |pg: Group| {
        let dev = if pg.rank() == 0 { Device::Cpu } else { CUDA0 };
        let t = Tensor::zeros_on(&[4], DType::F32, dev)?;
        Ok(pg.all_reduce(&t, ReduceOp::Sum).unwrap_err().to_string())
    })
    .unwrap();
    for e in &errs {
        assert!(
            e.contains("collective mismatch") && e.contains("on cuda"),
            "{e}"
        );
    }
    // One rank mixing a host input with a device output.
    let err = launch(&LaunchOptions::new(1), |pg: Group| {
        let out = Tensor::zeros_on(&[4], DType::F32, CUDA0)?;
        let inp = Tensor::zeros(&[4], DType::F32);
        Ok(pg
            .all_gather_into_tensor(&out, &inp)
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    assert!(
        err[0].contains("cuda:0") && err[0].contains("cpu"),
        "{}",
        err[0]
    );
}

fn gpt(seed: u64) -> Box<dyn Module> {
    let cfg = GptConfig {
        vocab_size: 29,
        block_size: 6,
        n_layer: 2,
        n_head: 3,
        n_embd: 12,
    };
    Box::new(GPT::new(cfg, seed).unwrap())
}

/// Forward + backward of rows `lo..hi` of step `step`'s batch (as `common::gpt_step`) with
/// the batch on `dev`; returns the loss.
fn step_on(
    m: &mut dyn Module,
    step: usize,
    lo: usize,
    hi: usize,
    dev: Device,
) -> fsdp::Result<f32> {
    let t = 6;
    let toks: Vec<i32> = values(400 + step as u64, 12 * (t + 1))
        .iter()
        .map(|v| ((v + 1.0) * 14.4) as i32 % 29)
        .collect();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for r in lo..hi {
        x.extend_from_slice(&toks[r * (t + 1)..r * (t + 1) + t]);
        y.extend_from_slice(&toks[r * (t + 1) + 1..(r + 1) * (t + 1)]);
    }
    let x = Tensor::from_vec(x, &[hi - lo, t])?.to_device(dev)?;
    let y = Tensor::from_vec(y, &[hi - lo, t])?.to_device(dev)?;
    let logits = m.forward(&x, &Context::train())?;
    let (l, g) = loss::cross_entropy(&logits, &y)?;
    m.backward(&g, &Context::train())?;
    Ok(l)
}

const STEPS: usize = 3;

/// Unsharded CPU training of the whole 12-row batch.
fn reference() -> Vec<(String, Vec<f32>)> {
    let mut m = gpt(3);
    let mut o = common::sgd(0.1);
    for step in 0..STEPS {
        step_on(m.as_mut(), step, 0, 12, Device::Cpu).unwrap();
        o.step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        fsdp::nn::zero_grad(m.as_mut());
    }
    common::named_values(m.as_mut())
}

fn fsdp_config(strategy: ShardingStrategy, world: usize, dev: Device) -> FsdpConfig {
    FsdpConfig {
        sharding_strategy: strategy,
        auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
        ranks_per_node: strategy
            .is_hybrid()
            .then(|| common::hybrid_ranks_per_node(world)),
        device_id: Some(dev),
        ..Default::default()
    }
}

/// FSDP training of the same batches split over `world` ranks; every rank's full
/// parameters afterwards.
fn sharded(world: usize, cfg: &(dyn Fn() -> FsdpConfig + Sync)) -> Vec<Vec<(String, Vec<f32>)>> {
    launch(&LaunchOptions::new(world), |pg: Group| {
        let c = cfg();
        let dev = c.device_id.unwrap_or(Device::Cpu);
        let mut m = FullyShardedDataParallel::new(gpt(3), pg.clone(), c)?;
        let mut o = common::sgd(0.1);
        let rows = 12 / world;
        for step in 0..STEPS {
            step_on(&mut m, step, pg.rank() * rows, (pg.rank() + 1) * rows, dev)?;
            o.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        m.full_parameters()
    })
    .unwrap()
}

fn compare(
    what: &str,
    got: &[Vec<(String, Vec<f32>)>],
    want: &[(String, Vec<f32>)],
    atol: f32,
    rtol: f32,
) {
    for (rank, g) in got.iter().enumerate() {
        assert_eq!(g.len(), want.len(), "{what}");
        for ((gn, gv), (wn, wv)) in g.iter().zip(want) {
            assert_eq!(gn, wn, "{what}");
            assert_close(&format!("{what} rank {rank} {gn}"), gv, wv, atol, rtol);
        }
    }
}

fn parity_on(dev: Device) {
    let want = reference();
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::HybridShard,
    ] {
        for world in [1, 2, 4] {
            let got = sharded(world, &|| fsdp_config(strategy, world, dev));
            compare(
                &format!("{strategy:?} world {world} on {dev}"),
                &got,
                &want,
                1e-5,
                1e-4,
            );
        }
    }
    // CPU offload: shards and the optimizer on the host, compute on the device.
    let got = sharded(2, &|| FsdpConfig {
        cpu_offload: CpuOffload {
            offload_params: true,
        },
        ..fsdp_config(ShardingStrategy::FullShard, 2, dev)
    });
    compare(
        &format!("FullShard offload world 2 on {dev}"),
        &got,
        &want,
        1e-5,
        1e-4,
    );
}

#[test]
fn fsdp_on_cuda_matches_unsharded_cpu_training_cuda() {
    if gpus("fsdp_on_cuda_matches_unsharded_cpu_training_cuda").is_some() {
        parity_on(CUDA0);
    }
}

#[test]
fn mixed_precision_bf16_on_cuda_matches_the_cpu_cuda() {
    if gpus("mixed_precision_bf16_on_cuda_matches_the_cpu_cuda").is_none() {
        return;
    }
    let run = |dev: Device| {
        sharded(2, &move || FsdpConfig {
            mixed_precision: Some(MixedPrecision::uniform(DType::BF16)),
            ..fsdp_config(ShardingStrategy::FullShard, 2, dev)
        })
    };
    let want = run(Device::Cpu);
    // Summation order differs on the GPU; a bf16 rounding may then land one ulp apart.
    compare("bf16 FullShard world 2", &run(CUDA0), &want[0], 2e-3, 1e-2);
}

/// The MLP of the PyTorch parity references (`tests/fsdp/mixed_precision_torch.rs`):
/// Linear(8, 16) -> GELU -> LayerNorm(16) -> Linear(16, 16) -> ReLU -> Linear(16, 4).
fn mlp() -> Box<dyn Module> {
    use fsdp::nn::{InitKey, LayerNorm, Linear, ReLU, Sequential, GELU};
    let k = InitKey::new(5);
    Box::new(Sequential::new(vec![
        Box::new(Linear::new(8, 16, true, &k.child("0")).unwrap()),
        Box::new(GELU::new()),
        Box::new(LayerNorm::new(16).unwrap()),
        Box::new(Linear::new(16, 16, true, &k.child("3")).unwrap()),
        Box::new(ReLU::new()),
        Box::new(Linear::new(16, 4, true, &k.child("5")).unwrap()),
    ]))
}

#[test]
fn bf16_and_f16_mlp_compute_on_device_tensors_as_on_the_cpu_cuda() {
    if gpus("bf16_and_f16_mlp_compute_on_device_tensors_as_on_the_cpu_cuda").is_none() {
        return;
    }
    // Every layer of a param_dtype unit takes and returns param_dtype device tensors
    // (Linear + bias, GELU, LayerNorm and its backward, ReLU, the MSE gradient, the
    // gradient's cast to reduce_dtype in the pack kernel), one unit per Linear, every
    // strategy at world 2, SGD; against the same training on the CPU.
    for d in [DType::BF16, DType::F16] {
        for strategy in [
            ShardingStrategy::FullShard,
            ShardingStrategy::ShardGradOp,
            ShardingStrategy::NoShard,
        ] {
            let run = |dev: Device| {
                launch(&LaunchOptions::new(2), |pg: Group| {
                    let cfg = FsdpConfig {
                        sharding_strategy: strategy,
                        auto_wrap_policy: Some(fsdp::fsdp::module_wrap_policy(["Linear"])),
                        mixed_precision: Some(MixedPrecision {
                            param_dtype: Some(d),
                            reduce_dtype: Some(DType::F32),
                            ..Default::default()
                        }),
                        device_id: Some(dev),
                        ..Default::default()
                    };
                    let mut m = FullyShardedDataParallel::new(mlp(), pg.clone(), cfg)?;
                    let mut o = common::sgd(0.1);
                    let r = pg.rank();
                    let mut outs = Vec::new();
                    for step in 0..STEPS {
                        let x = values(50 + step as u64, 12 * 8)[r * 48..(r + 1) * 48].to_vec();
                        let t = values(60 + step as u64, 12 * 4)[r * 24..(r + 1) * 24].to_vec();
                        let x = Tensor::from_vec(x, &[6, 8])?.to_device(dev)?;
                        let t = Tensor::from_vec(t, &[6, 4])?.to_device(dev)?;
                        let out = m.forward(&x, &Context::train())?;
                        assert_eq!(out.dtype(), d);
                        assert_eq!(out.device(), dev);
                        let (_, g) = loss::mse_loss(&out, &t)?;
                        assert_eq!(g.dtype(), d);
                        m.backward(&g, &Context::train())?;
                        o.step(&m.optimizer_params())?;
                        m.zero_grad();
                        outs.extend(out.to_vec_f32()?);
                    }
                    let mut p = m.full_parameters()?;
                    p.push(("outputs".into(), outs));
                    Ok(p)
                })
                .unwrap()
            };
            let want = run(Device::Cpu);
            // GEMMs and row sums add in another order on the device (and the CPU's GELU
            // uses PyTorch's CPU erf): a rounding may land one param_dtype ulp apart.
            let got = run(CUDA0);
            for r in 0..2 {
                let what = format!("{d} {strategy:?} world 2 rank {r}");
                compare(&what, &got[r..r + 1], &want[r], 4e-3, 2e-2);
            }
        }
    }
}

fn clip_on(dev: Device) {
    let run = |dev: Device| {
        launch(&LaunchOptions::new(2), move |pg: Group| {
            let cfg = fsdp_config(ShardingStrategy::FullShard, 2, dev);
            let mut m = FullyShardedDataParallel::new(gpt(3), pg.clone(), cfg)?;
            step_on(&mut m, 0, pg.rank() * 6, (pg.rank() + 1) * 6, dev)?;
            let inf = m.clip_grad_norm_(1e9, f32::INFINITY)?;
            let three = m.clip_grad_norm_(1e9, 3.0)?;
            let two = m.clip_grad_norm_(0.05, 2.0)?;
            let grads: Vec<Vec<f32>> = m
                .optimizer_params()
                .iter()
                .filter_map(|p| p.grad.as_ref().map(|g| g.to_vec_f32()))
                .collect::<fsdp::Result<_>>()?;
            Ok((vec![inf, three, two], grads))
        })
        .unwrap()
    };
    let (want, got) = (run(Device::Cpu), run(dev));
    for (rank, ((gn, gg), (wn, wg))) in got.iter().zip(&want).enumerate() {
        assert_close(&format!("norms rank {rank}"), gn, wn, 0.0, 1e-5);
        assert!(wn[2] > 0.05, "the 2-norm {} must be clipped", wn[2]);
        for (g, w) in gg.iter().zip(wg) {
            assert_close(&format!("clipped grads rank {rank}"), g, w, 1e-7, 1e-4);
        }
    }
}

#[test]
fn clip_grad_norm_on_cuda_matches_the_cpu_cuda() {
    if gpus("clip_grad_norm_on_cuda_matches_the_cpu_cuda").is_some() {
        clip_on(CUDA0);
    }
}

fn state_dicts_on(dev: Device) {
    let original: Vec<(String, Vec<f32>)> = {
        let mut m = gpt(3);
        common::named_values(m.as_mut())
    };
    let dir = std::env::temp_dir().join(format!("fsdp-cuda-ckpt-{}-{dev}", std::process::id()));
    for world in [1, 2, 4] {
        let out = launch(&LaunchOptions::new(world), |pg: Group| {
            let cfg = || fsdp_config(ShardingStrategy::FullShard, world, dev);
            let mut m = FullyShardedDataParallel::new(gpt(3), pg.clone(), cfg())?;
            assert_eq!(m.flat_param().local_shard().device(), dev);
            let on_gpu = m.full_state_dict(FullStateDictConfig {
                offload_to_cpu: false,
                rank0_only: false,
            })?;
            assert!(on_gpu.tensors.iter().all(|(_, t)| t.device() == dev));
            let full = m.full_state_dict(FullStateDictConfig {
                offload_to_cpu: true,
                rank0_only: false,
            })?;
            assert!(full.tensors.iter().all(|(_, t)| t.device() == Device::Cpu));
            let sharded = m.sharded_state_dict()?;
            // Another init, then the state dict: the first model's values on the GPU.
            let mut m2 = FullyShardedDataParallel::new(gpt(4), pg.clone(), cfg())?;
            m2.load_state_dict(&StateDict::Sharded(sharded), true)?;
            let loaded = m2.full_parameters()?;
            // A checkpoint written from the GPU and read back into it.
            let ckpt = dir.join(format!("w{world}"));
            fsdp::checkpoint::save_checkpoint(
                &ckpt,
                &mut m,
                None,
                fsdp::fsdp::StateDictType::Sharded,
                serde_json::Value::Null,
            )?;
            let mut m3 = FullyShardedDataParallel::new(gpt(5), pg.clone(), cfg())?;
            fsdp::checkpoint::load_checkpoint(&ckpt, &mut m3, None)?;
            // summon_full_params writes back into the device shards.
            m3.summon_full_params(true, |u| {
                visit_parameters(u.module_mut(), "", false, &mut |_, p| {
                    fsdp::ops::fill_(p.data().unwrap(), 0.5).unwrap();
                    Ok(())
                })
                .unwrap();
                Ok(())
            })?;
            let summoned = m3.full_parameters()?;
            let _ = m3.state_dict(StateDictConfig::Local)?;
            Ok((full.tensors, loaded, summoned))
        })
        .unwrap();
        for (full, loaded, summoned) in &out {
            for ((name, t), (wn, wv)) in full.iter().zip(&original) {
                assert_eq!(name, wn);
                assert_eq!(
                    &t.to_vec_f32().unwrap(),
                    wv,
                    "full state dict world {world} {name}"
                );
            }
            assert_eq!(loaded, &original, "sharded load world {world}");
            assert!(summoned.iter().all(|(_, v)| v.iter().all(|&x| x == 0.5)));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn state_dicts_and_checkpoints_go_through_the_host_cuda() {
    if gpus("state_dicts_and_checkpoints_go_through_the_host_cuda").is_some() {
        state_dicts_on(CUDA0);
    }
}

fn train_job_on(device: fsdp::train::TrainDevice) {
    let data = common::corpus_file(&format!("train-{device}"));
    let cfg = |device, world| fsdp::train::TrainConfig {
        steps: 5,
        device,
        ..common::small_job(data.clone(), world)
    };
    let want = fsdp::train::train(&cfg(fsdp::train::TrainDevice::Cpu, 1), &fsdp::train::Silent)
        .unwrap()
        .losses();
    for world in [1, 2] {
        let report = fsdp::train::train(&cfg(device, world), &fsdp::train::Silent).unwrap();
        assert_close(
            &format!("losses world {world} on {device}"),
            &report.losses(),
            &want,
            0.0,
            1e-4,
        );
        let peaks: Vec<usize> = report.records[0]
            .ranks
            .iter()
            .map(|r| r.device_peak_bytes)
            .collect();
        let on_gpu = device == fsdp::train::TrainDevice::Cuda;
        assert!(
            peaks.iter().all(|&b| (b > 0) == on_gpu),
            "device peak bytes {peaks:?}"
        );
    }
}

#[test]
fn train_job_on_cuda_matches_the_cpu_cuda() {
    if gpus("train_job_on_cuda_matches_the_cpu_cuda").is_some() {
        train_job_on(fsdp::train::TrainDevice::Cuda);
    }
}

/// The harness of the tests above run with the CPU in the GPU's place, so their
/// bookkeeping is checked on every machine (the CUDA runs add only the device).
#[test]
fn harness_of_the_gpu_tests_on_the_cpu() {
    check_collectives(&[1, 3], &[0, 5], &|_| Device::Cpu);
    parity_on(Device::Cpu);
    clip_on(Device::Cpu);
    state_dicts_on(Device::Cpu);
    train_job_on(fsdp::train::TrainDevice::Cpu);
}

#[test]
fn buffer_pool_reuses_a_buffer_only_behind_its_stream_job_cuda() {
    let name = "buffer_pool_reuses_a_buffer_only_behind_its_stream_job_cuda";
    let Some(_) = gpus(name) else {
        return;
    };
    // As above: only under the emulator's deferral is the unordered read sure to be stale,
    // and the check runs alone, in a child process.
    const CHILD: &str = "FSDP_TEST_POOL_ORDER_CHILD";
    let deferred = fsdp::backend::cuda::detect().unwrap()[0]
        .name
        .contains("cuda-emu")
        && std::env::var("CUDA_EMU_SCHEDULE").map_or(true, |v| v != "eager");
    if deferred && !common::run_alone(module_path!(), name, CHILD) {
        return;
    }
    use fsdp::fsdp::BufferPool;
    let n = 1 << 16;
    launch(&LaunchOptions::new(1), |_pg: Group| {
        let stream = CommStream::on_device("test-comm", CUDA0)?;
        // Reuse at once behind the job (no buffer kept in flight).
        let mut pool = BufferPool::new(true, 0);
        let buf = pool.take(n, DType::F32, CUDA0)?;
        fsdp::ops::fill_(&buf, 7.0)?;
        let out = Tensor::zeros_on(&[n], DType::F32, CUDA0)?;
        let (src, dst) = (buf.clone(), out.clone());
        let copy =
            stream.submit_keeping(vec![buf.clone(), out.clone()], move || dst.copy_from(&src));
        #[cfg(feature = "cuda")]
        let ptr = buf.as_device_tensor()?.ptr();
        pool.give_after(buf, &stream);
        // The same block comes back, and the compute stream waits for the copy before
        // anything it queues next: the fill below cannot overtake the copy's read.
        let again = pool.take(n, DType::F32, CUDA0)?;
        #[cfg(feature = "cuda")]
        assert_eq!(
            again.as_device_tensor()?.ptr(),
            ptr,
            "the buffer was not reused"
        );
        fsdp::ops::fill_(&again, 9.0)?;
        // Runs the compute stream first (its fill, behind its wait for the copy).
        assert!(again.to_vec_f32()?.iter().all(|&x| x == 9.0));
        copy.wait()?;
        let v = out.to_vec_f32()?;
        assert!(
            v.iter().all(|&x| x == 7.0),
            "the stream job read the reused buffer's new values: {:?}",
            &v[..4]
        );
        // The same steps reusing the buffer without the pool's wait: the compute stream's
        // fill overtakes the job's read under deferral, which this check would catch.
        let buf = Tensor::zeros_on(&[n], DType::F32, CUDA0)?;
        fsdp::ops::fill_(&buf, 7.0)?;
        let out = Tensor::zeros_on(&[n], DType::F32, CUDA0)?;
        let (src, dst) = (buf.clone(), out.clone());
        let copy =
            stream.submit_keeping(vec![buf.clone(), out.clone()], move || dst.copy_from(&src));
        stream.synchronize();
        fsdp::ops::fill_(&buf, 9.0)?;
        assert!(buf.to_vec_f32()?.iter().all(|&x| x == 9.0));
        copy.wait()?;
        let v = out.to_vec_f32()?;
        if deferred {
            assert!(
                v.iter().any(|&x| x != 7.0),
                "the unordered reuse did not overtake the job"
            );
        }
        Ok(())
    })
    .unwrap();
}

/// Runs `body` in a child process of this test binary running only test `name`, when a GPU
/// is found: a graph capture routes every allocation of the device to its pool and forbids
/// other threads' synchronizations (global capture mode), which the tests running beside
/// it would trip.
fn in_own_process(name: &str, body: impl FnOnce()) {
    if gpus(name).is_some() && common::run_alone(module_path!(), name, "FSDP_TEST_OWN_PROCESS") {
        body();
    }
}

/// `fsdp train --cuda-graphs`: steps 1-2 eager, 3 captured and launched, 4-8 replayed, with
/// the same losses as the eager run bit for bit (the same kernels on the same data), one
/// graph launch and no kernel launch per replayed step. Under `FSDP_CUDA_NO_CACHING=1` the
/// capture is refused (every buffer would be a `cuMemAlloc`), named.
#[test]
fn cuda_graph_steps_equal_eager_steps_bitwise_cuda() {
    in_own_process(
        "cuda_graph_steps_equal_eager_steps_bitwise_cuda",
        graph_steps,
    );
}

fn graph_steps() {
    let data = common::corpus_file("train-graphs");
    for accum in [1, 2] {
        let cfg = |graphs| fsdp::train::TrainConfig {
            steps: 8,
            device: fsdp::train::TrainDevice::Cuda,
            warmup_steps: 0,
            grad_accum: accum,
            global_batch: 4,
            cuda_graphs: graphs,
            ..common::small_job(data.clone(), 1)
        };
        if !graph_equals_eager(&format!("grad accum {accum}"), &cfg) {
            return;
        }
    }
}

/// Trains `cfg(false)` (eager) and `cfg(true)` (`--cuda-graphs`) and checks that their
/// losses are equal bit for bit, that steps 1-2 launch no graph and every later step
/// exactly one, and that replayed steps (4 on) launch no kernel. False (after checking the
/// error) when the capture was refused under `FSDP_CUDA_NO_CACHING=1`.
fn graph_equals_eager(what: &str, cfg: &dyn Fn(bool) -> fsdp::train::TrainConfig) -> bool {
    let want = fsdp::train::train(&cfg(false), &fsdp::train::Silent).unwrap();
    let got = match fsdp::train::train(&cfg(true), &fsdp::train::Silent) {
        Err(e) if std::env::var("FSDP_CUDA_NO_CACHING").is_ok_and(|v| v == "1") => {
            assert!(e.to_string().contains("caching allocator"), "{e}");
            return false;
        }
        r => r.unwrap(),
    };
    let bits = |r: &fsdp::train::TrainReport| -> Vec<u32> {
        r.losses().iter().map(|l| l.to_bits()).collect()
    };
    assert_eq!(
        bits(&got),
        bits(&want),
        "{what}: losses {:?} vs eager {:?}",
        got.losses(),
        want.losses()
    );
    let graphs: Vec<u64> = got
        .records
        .iter()
        .map(|r| r.counters.graph_launches)
        .collect();
    let mut expected = vec![1; got.records.len()];
    expected[..2].fill(0);
    assert_eq!(graphs, expected, "{what}: graph launches per step");
    for r in &got.records[3..] {
        assert_eq!(
            r.counters.kernel_launches, 0,
            "{what}: step {}: {:?}",
            r.step, r.counters
        );
    }
    assert!(want.records[3].counters.kernel_launches > 0);
    let per_step = |r: &fsdp::train::TrainReport,
                    f: fn(&fsdp::backend::counters::Counters) -> u64| {
        r.records.iter().map(|r| f(&r.counters)).collect::<Vec<_>>()
    };
    eprintln!(
        "cuda graphs ({what}): kernel launches per step eager {:?}, graph {:?}; device allocations eager {:?}, graph {:?}",
        per_step(&want, |c| c.kernel_launches),
        per_step(&got, |c| c.kernel_launches),
        per_step(&want, |c| c.device_allocs),
        per_step(&got, |c| c.device_allocs),
    );
    true
}

/// An lr schedule under `--cuda-graphs` (a warm-up of 3 steps, then cosine decay to lr / 10
/// over 10 steps: a new rate at every replay, read from the graph's table on the device)
/// gives the eager run's losses bit for bit, with Adam and AdamW; SGD, whose kernel takes
/// the rate as an argument, is refused with a schedule, naming the option.
#[test]
fn cuda_graph_steps_follow_an_lr_schedule_bitwise_cuda() {
    in_own_process(
        "cuda_graph_steps_follow_an_lr_schedule_bitwise_cuda",
        scheduled_graph_steps,
    );
}

fn scheduled_graph_steps() {
    use fsdp::optim::OptimizerKind;
    let data = common::corpus_file("train-graph-schedule");
    let cfg = |optimizer, graphs| fsdp::train::TrainConfig {
        steps: 10,
        device: fsdp::train::TrainDevice::Cuda,
        warmup_steps: 3,
        lr_schedule: fsdp::train::LrSchedule::Cosine,
        optimizer,
        global_batch: 4,
        cuda_graphs: graphs,
        ..common::small_job(data.clone(), 1)
    };
    // The schedule moves the rate at every step the graph replays (4 on).
    let c = cfg(OptimizerKind::Adamw, true);
    let lrs: Vec<f32> = (1..=c.steps).map(|s| c.lr_at(s)).collect();
    assert!(lrs[3..].windows(2).all(|w| w[0] > w[1]), "{lrs:?}");
    for opt in [OptimizerKind::Adamw, OptimizerKind::Adam] {
        if !graph_equals_eager(&format!("{opt}, warm-up + cosine"), &|g| cfg(opt, g)) {
            return;
        }
    }
    let e = fsdp::train::train(&cfg(OptimizerKind::Sgd, true), &fsdp::train::Silent)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--cuda-graphs") && e.contains("--optimizer sgd"),
        "{e}"
    );
}

/// What a captured step may not do is refused at capture with the operation's name: a read
/// of a device value to the host (a host synchronization), and an allocation the warm-up
/// did not make; the warm-up's own work runs, and a clean capture replays.
/// (The recorder is an API of the `cuda` feature's backend only.)
#[cfg(feature = "cuda")]
#[test]
fn a_host_sync_in_a_captured_step_is_refused_by_name_cuda() {
    in_own_process(
        "a_host_sync_in_a_captured_step_is_refused_by_name_cuda",
        refused_capture,
    );
}

#[cfg(feature = "cuda")]
fn refused_capture() {
    use fsdp::backend::cuda::{current_stream, GraphRecorder};
    let s = current_stream(0).unwrap();
    let rec = match GraphRecorder::new(&s) {
        Err(e) if std::env::var("FSDP_CUDA_NO_CACHING").is_ok_and(|v| v == "1") => {
            assert!(e.to_string().contains("FSDP_CUDA_NO_CACHING"), "{e}");
            return;
        }
        r => r.unwrap(),
    };
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])
        .unwrap()
        .to_device(CUDA0)
        .unwrap();
    let step = || -> fsdp::Result<Tensor> {
        let y = fsdp::ops::add(&x, &x)?; // a new buffer each step
        fsdp::ops::add_(&x, &y)?; // x += x + x
        Ok(y)
    };
    let y = rec.warm_up(step).unwrap();
    assert_eq!(x.to_vec_f32().unwrap(), [3.0, 6.0, 9.0]);
    drop(y);
    let e = rec
        .capture(|| {
            step()?;
            x.to_vec_f32() // the host waits for the device: not capturable
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("during a CUDA graph capture"), "{e}");
    assert!(e.contains("STREAM_CAPTURE"), "{e}");
    eprintln!("refused: {e}");
    // An allocation of a size the warm-up never made.
    let rec = GraphRecorder::new(&s).unwrap();
    rec.warm_up(step).unwrap();
    let e = rec
        .capture(|| Tensor::zeros_on(&[1 << 20], DType::F32, CUDA0))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("allocating 4194304 B") && e.contains("during a CUDA graph capture"),
        "{e}"
    );
    // A clean capture: nothing runs until launched, then each launch is one step.
    let rec = GraphRecorder::new(&s).unwrap();
    let kept = rec.warm_up(step).unwrap();
    drop(kept);
    let before = x.to_vec_f32().unwrap(); // [x2] after three warm-ups
    let (g, y) = rec.capture(step).unwrap();
    assert_eq!(x.to_vec_f32().unwrap(), before, "captured, not run");
    g.launch().unwrap();
    let once: Vec<f32> = before.iter().map(|v| 3.0 * v).collect();
    assert_eq!(x.to_vec_f32().unwrap(), once);
    g.launch().unwrap();
    let twice: Vec<f32> = once.iter().map(|v| 3.0 * v).collect();
    assert_eq!(x.to_vec_f32().unwrap(), twice);
    assert_eq!(
        y.to_vec_f32().unwrap(),
        once.iter().map(|v| 2.0 * v).collect::<Vec<_>>(),
        "y is the graph's block, written again by the second launch"
    );
}
