//! The fourth example of PyTorch's FullyShardedDataParallel docs: 4 blocks of
//! Linear(512, 512) - ReLU - Linear(512, 512) and a Linear(512, 10) head, each block its
//! own FSDP unit through `transformer_auto_wrap_policy`; prints the output shape, [4, 10],
//! how many units were made, and the sum and first values of the output.
//!
//! Initialized as PyTorch does after `torch.manual_seed(0)` ([`InitKey::torch`]), input
//! `torch.randn(4, 512)`: PyTorch 2.11 on the CPU prints `[4, 10] (5 FSDP units: 4 blocks +
//! root) sum -0.04869658499956131 first [0.034956201910972595, 0.05563748627901077,
//! -0.007487209513783455, 0.010826939716935158]` (`tests/torch_ref/fsdp_examples.txt`);
//! this prints the same to f32 rounding.
//!
//! `cargo run --release --example transformer_blocks` (`WORLD_SIZE=4` for 4 ranks)

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::error::Result;
use fsdp::fsdp::{transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel};
use fsdp::nn::{Context, InitKey, Linear, Module, ReLU, Sequential};

/// PyTorch's `TransformerBlock`: `self.net = nn.Sequential(Linear(512, 512), ReLU(),
/// Linear(512, 512))`, built from named containers: its parameters are named
/// `{i}.net.0.weight` as in PyTorch, and its type name is what the policy matches.
fn transformer_block(k: &InitKey) -> Result<Box<dyn Module>> {
    let net = Sequential::new(vec![
        Box::new(Linear::new(512, 512, true, &k.child("0"))?),
        Box::new(ReLU::new()),
        Box::new(Linear::new(512, 512, true, &k.child("2"))?),
    ]);
    let net: Box<dyn Module> = Box::new(net);
    Ok(Box::new(
        Sequential::named(vec![("net", net)])?.with_type_name("TransformerBlock"),
    ))
}

fn main() -> std::process::ExitCode {
    fsdp::exit_code(run())
}

fn run() -> Result<()> {
    let opts = LaunchOptions::from_env_or(2)?;
    let out = launch(&opts, |pg| {
        let k = InitKey::torch(0);
        let mut layers: Vec<Box<dyn Module>> = Vec::new();
        for i in 0..4 {
            layers.push(transformer_block(&k.child(&i.to_string()))?);
        }
        layers.push(Box::new(Linear::new(512, 10, true, &k.child("4"))?));
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["TransformerBlock"])),
            ..Default::default()
        };
        let mut model = FullyShardedDataParallel::new(Box::new(Sequential::new(layers)), pg, cfg)?;
        let mut units = 0;
        model.for_each_unit(&mut |_| {
            units += 1;
            Ok(())
        })?;
        let y = model.forward(&k.randn(&[4, 512])?, &Context::train())?;
        Ok((y.shape().to_vec(), units, y.to_vec_f32()?))
    })?;
    let (shape, units, y) = &out[0];
    let sum = y.iter().map(|&v| v as f64).sum::<f64>() as f32 as f64;
    let first: Vec<f64> = y.iter().take(4).map(|&v| v as f64).collect();
    println!("{shape:?} ({units} FSDP units: 4 blocks + root) sum {sum:?} first {first:?}");
    Ok(())
}
