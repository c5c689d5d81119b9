//! The first example of PyTorch's FullyShardedDataParallel docs: a 1024-512-128 MLP wrapped
//! whole with FullShard on 2 thread ranks; prints the output shape, [8, 128].
//!
//! `cargo run --release --example simple_model` (`WORLD_SIZE=4` for 4 ranks)

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel, ShardingStrategy};
use fsdp::nn::{Context, InitKey, Linear, Module, ReLU, Sequential};
use fsdp::tensor::Tensor;

fn main() -> std::process::ExitCode {
    fsdp::exit_code(run())
}

fn run() -> fsdp::Result<()> {
    let opts = LaunchOptions::from_env_or(2)?;
    let shapes = launch(&opts, |pg| {
        let k = InitKey::new(0);
        let model = Sequential::new(vec![
            Box::new(Linear::new(1024, 512, true, &k.child("0"))?),
            Box::new(ReLU::new()),
            Box::new(Linear::new(512, 128, true, &k.child("2"))?),
        ]);
        let cfg = FsdpConfig {
            sharding_strategy: ShardingStrategy::FullShard,
            ..Default::default()
        };
        let mut model = FullyShardedDataParallel::new(Box::new(model), pg, cfg)?;
        let x = Tensor::from_vec(vec![0.5f32; 8 * 1024], &[8, 1024])?;
        let y = model.forward(&x, &Context::train())?;
        Ok(y.shape().to_vec())
    })?;
    println!("{:?}", shapes[0]);
    Ok(())
}
