//! The second example of PyTorch's FullyShardedDataParallel docs: a 256-128-64 model with
//! ShardGradOp, Adam(lr=1e-3), loss = sum of the outputs, one optimizer step; prints the loss
//! (identical on every rank) and the shape of the output.
//!
//! `cargo run --release --example shard_grad_op` (`WORLD_SIZE=4` for 4 ranks)

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel, ShardingStrategy};
use fsdp::nn::{loss, Context, InitKey, Linear, Module, ReLU, Sequential};
use fsdp::optim::{Adam, AdamConfig, Optimizer};
use fsdp::tensor::Tensor;

fn main() -> std::process::ExitCode {
    fsdp::exit_code(run())
}

fn run() -> fsdp::Result<()> {
    let opts = LaunchOptions::from_env_or(2)?;
    let out = launch(&opts, |pg| {
        let k = InitKey::new(0);
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
        let x = Tensor::from_vec(vec![0.1f32; 4 * 256], &[4, 256])?;
        let y = model.forward(&x, &Context::train())?;
        let (l, dy) = loss::sum_loss(&y)?;
        model.backward(&dy, &Context::train())?;
        opt.step(&model.optimizer_params())?;
        Ok((l, y.shape().to_vec()))
    })?;
    println!("loss {:.6} output {:?}", out[0].0, out[0].1);
    Ok(())
}
