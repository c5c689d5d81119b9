//! The first example of PyTorch's FullyShardedDataParallel docs: a 1024-512-128 MLP wrapped
//! whole with FullShard on 2 thread ranks; prints the output shape, [8, 128], the sum of the
//! output and its first values.
//!
//! Initialized as PyTorch does after `torch.manual_seed(0)` ([`InitKey::torch`]), input
//! `torch.randn(8, 1024)`: PyTorch 2.11 on the CPU prints `[8, 128] sum -2.02225923538208
//! first [-0.23576918244361877, 0.07231025397777557, 0.2641046643257141,
//! -0.2737515866756439]` (`tests/torch_ref/fsdp_examples.txt`); this prints the same to f32
//! rounding.
//!
//! `cargo run --release --example simple_model` (`WORLD_SIZE=4` for 4 ranks)

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel, ShardingStrategy};
use fsdp::nn::{Context, InitKey, Linear, Module, ReLU, Sequential};

fn main() -> std::process::ExitCode {
    fsdp::exit_code(run())
}

fn run() -> fsdp::Result<()> {
    let opts = LaunchOptions::from_env_or(2)?;
    let outs = launch(&opts, |pg| {
        let k = InitKey::torch(0);
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
        let x = k.randn(&[8, 1024])?;
        let y = model.forward(&x, &Context::train())?;
        Ok((y.shape().to_vec(), y.to_vec_f32()?))
    })?;
    let (shape, y) = &outs[0];
    println!("{shape:?} sum {:?} first {:?}", sum(y), first(y));
    Ok(())
}

/// The sum of `v` rounded to f32 (`y.sum().item()`), as the f64 it converts to.
fn sum(v: &[f32]) -> f64 {
    v.iter().map(|&x| x as f64).sum::<f64>() as f32 as f64
}

/// The first four values as f64 (`y.flatten()[:4].tolist()`).
fn first(v: &[f32]) -> Vec<f64> {
    v.iter().take(4).map(|&x| x as f64).collect()
}
