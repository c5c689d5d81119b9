//! The third example of PyTorch's FullyShardedDataParallel docs: a Linear(2048, 2048)
//! "BigModel" with its parameter and gradient shards offloaded to host memory
//! (`CpuOffload { offload_params: true }`); one forward and backward of a [2, 2048] batch
//! and an SGD step, then prints the output shape, [2, 2048], the sum and first values of
//! the output, and where the shards live.
//!
//! Initialized as PyTorch does after `torch.manual_seed(0)` ([`InitKey::torch`]), input
//! `torch.randn(2, 2048)`: PyTorch 2.11 on the CPU prints `[2, 2048] sum 52.27349853515625
//! first [-0.19608768820762634, 0.8921292424201965, 0.18506589531898499,
//! 0.23419275879859924]` (`tests/torch_ref/fsdp_examples.txt`, without the offload, which
//! needs CUDA in PyTorch); this prints the same to f32 rounding.
//!
//! `cargo run --release --example big_model` (`WORLD_SIZE=4` for 4 ranks)

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{CpuOffload, FsdpConfig, FullyShardedDataParallel};
use fsdp::nn::{loss, Context, InitKey, Linear, Module};
use fsdp::optim::{Optimizer, SgdConfig, SGD};

fn main() -> std::process::ExitCode {
    fsdp::exit_code(run())
}

fn run() -> fsdp::Result<()> {
    let opts = LaunchOptions::from_env_or(2)?;
    let out = launch(&opts, |pg| {
        let k = InitKey::torch(0);
        let model = Linear::new(2048, 2048, true, &k)?;
        let cfg = FsdpConfig {
            cpu_offload: CpuOffload {
                offload_params: true,
            },
            ..Default::default()
        };
        let mut model = FullyShardedDataParallel::new(Box::new(model), pg, cfg)?;
        let x = k.randn(&[2, 2048])?;
        let y = model.forward(&x, &Context::train())?;
        let (_, g) = loss::sum_loss(&y)?;
        model.backward(&g, &Context::train())?;
        let mut opt = SGD::new(SgdConfig {
            lr: 1e-3,
            ..Default::default()
        });
        opt.step(&model.optimizer_params())?;
        Ok((y.shape().to_vec(), y.to_vec_f32()?, model.memory_stats()))
    })?;
    let (shape, y, mem) = &out[0];
    let sum = y.iter().map(|&v| v as f64).sum::<f64>() as f32 as f64;
    let first: Vec<f64> = y.iter().take(4).map(|&v| v as f64).collect();
    println!("{shape:?} sum {sum:?} first {first:?}");
    println!(
        "rank 0: {} parameter bytes + {} gradient bytes in host memory (cpu_offload {})",
        mem.param_shard_bytes, mem.grad_shard_bytes, mem.cpu_offload
    );
    Ok(())
}
