//! The second example of PyTorch's FullyShardedDataParallel docs: a 256-128-64 model with
//! ShardGradOp, Adam(lr=1e-3), loss = sum of the outputs, one optimizer step; prints the loss
//! (identical on every rank) and the shape of the output.
//!
//! Initialized as PyTorch does after `torch.manual_seed(0)` ([`InitKey::torch`]), with the
//! input `torch.randn(4, 256)` drawn after the model, so it prints what PyTorch prints for
//! the same script on the CPU: PyTorch 2.11 gives `loss -7.676543235778809 output [4, 64]`
//! (`tests/torch_ref/fsdp_examples.txt`; -7.676541805267334 on other CPUs, a different
//! summation order of the GEMM), at every world size.
//!
//! `cargo run --release --example shard_grad_op` (`WORLD_SIZE=4` for 4 ranks)

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel, ShardingStrategy};
use fsdp::nn::{loss, Context, InitKey, Linear, Module, ReLU, Sequential};
use fsdp::optim::{Adam, AdamConfig, Optimizer};

fn main() -> std::process::ExitCode {
    fsdp::exit_code(run())
}

fn run() -> fsdp::Result<()> {
    let opts = LaunchOptions::from_env_or(2)?;
    let out = launch(&opts, |pg| {
        // torch.manual_seed(0) on every rank: the same model and input everywhere.
        let k = InitKey::torch(0);
        let model = Sequential::new(vec![
            Box::new(Linear::new(256, 128, true, &k.child("0"))?),
            Box::new(ReLU::new()),
            Box::new(Linear::new(128, 64, true, &k.child("2"))?),
        ]);
        let cfg = FsdpConfig {
            sharding_strategy: ShardingStrategy::ShardGradOp,
            ..Default::default()
        };
        let mut model = FullyShardedDataParallel::new(Box::new(model), pg.clone(), cfg)?;
        let mut opt = Adam::new(AdamConfig {
            lr: 1e-3,
            ..AdamConfig::adam()
        });
        let x = k.randn(&[4, 256])?;
        let y = model.forward(&x, &Context::train())?;
        let (l, dy) = loss::sum_loss(&y)?;
        model.backward(&dy, &Context::train())?;
        opt.step(&model.optimizer_params())?;
        Ok((l, y.shape().to_vec()))
    })?;
    println!("loss {:?} output {:?}", out[0].0 as f64, out[0].1);
    Ok(())
}
