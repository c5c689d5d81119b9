//! The third example of PyTorch's FullyShardedDataParallel docs: a Linear(2048, 2048)
//! "BigModel" with its parameter and gradient shards offloaded to host memory
//! (`CpuOffload { offload_params: true }`); one forward and backward of a [2, 2048] batch
//! and an SGD step, then prints the output shape, [2, 2048], and where the shards live.
//!
//! `cargo run --release --example big_model` (`WORLD_SIZE=4` for 4 ranks)

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{CpuOffload, FsdpConfig, FullyShardedDataParallel};
use fsdp::nn::{loss, Context, InitKey, Linear, Module};
use fsdp::optim::{Optimizer, SgdConfig, SGD};
use fsdp::tensor::Tensor;

fn main() -> std::process::ExitCode {
    fsdp::exit_code(run())
}

fn run() -> fsdp::Result<()> {
    let opts = LaunchOptions::from_env_or(2)?;
    let out = launch(&opts, |pg| {
        let model = Linear::new(2048, 2048, true, &InitKey::new(0))?;
        let cfg = FsdpConfig {
            cpu_offload: CpuOffload {
                offload_params: true,
            },
            ..Default::default()
        };
        let mut model = FullyShardedDataParallel::new(Box::new(model), pg, cfg)?;
        let x = Tensor::from_vec(vec![0.01f32; 2 * 2048], &[2, 2048])?;
        let y = model.forward(&x, &Context::train())?;
        let (_, g) = loss::sum_loss(&y)?;
        model.backward(&g, &Context::train())?;
        let mut opt = SGD::new(SgdConfig {
            lr: 1e-3,
            ..Default::default()
        });
        opt.step(&model.optimizer_params())?;
        Ok((y.shape().to_vec(), model.memory_stats()))
    })?;
    let (shape, mem) = &out[0];
    println!("{shape:?}");
    println!(
        "rank 0: {} parameter bytes + {} gradient bytes in host memory (cpu_offload {})",
        mem.param_shard_bytes, mem.grad_shard_bytes, mem.cpu_offload
    );
    Ok(())
}
