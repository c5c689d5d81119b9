//! The fourth example of PyTorch's FullyShardedDataParallel docs: 4 blocks of
//! Linear(512, 512) - ReLU - Linear(512, 512) and a Linear(512, 10) head, each block its
//! own FSDP unit through `transformer_auto_wrap_policy`; prints the output shape, [4, 10],
//! and how many units were made.
//!
//! `cargo run --release --example transformer_blocks` (`WORLD_SIZE=4` for 4 ranks)

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::error::Result;
use fsdp::fsdp::{transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel};
use fsdp::nn::{ChildVisitor, Context, InitKey, Linear, Module, ReLU, Sequential};
use fsdp::tensor::Tensor;

/// Linear(512, 512) - ReLU - Linear(512, 512), a type of its own so the policy can match it.
struct TransformerBlock(Sequential);

impl TransformerBlock {
    fn new(k: &InitKey) -> Result<Self> {
        Ok(TransformerBlock(Sequential::new(vec![
            Box::new(Linear::new(512, 512, true, &k.child("0"))?),
            Box::new(ReLU::new()),
            Box::new(Linear::new(512, 512, true, &k.child("2"))?),
        ])))
    }
}

impl Module for TransformerBlock {
    fn type_name(&self) -> &'static str {
        "TransformerBlock"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.0.forward(x, cx)
    }
    fn backward(&mut self, g: &Tensor, cx: &Context) -> Result<Tensor> {
        self.0.backward(g, cx)
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        self.0.for_each_child(f)
    }
}

fn main() -> std::process::ExitCode {
    fsdp::exit_code(run())
}

fn run() -> Result<()> {
    let opts = LaunchOptions::from_env_or(2)?;
    let out = launch(&opts, |pg| {
        let k = InitKey::new(0);
        let mut layers: Vec<Box<dyn Module>> = Vec::new();
        for i in 0..4 {
            layers.push(Box::new(TransformerBlock::new(&k.child(&i.to_string()))?));
        }
        layers.push(Box::new(Linear::new(512, 10, true, &k.child("4"))?));
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["TransformerBlock"])),
            ..Default::default()
        };
        let mut model = FullyShardedDataParallel::new(Box::new(Sequential::new(layers)), pg, cfg)?;
        let mut units = 0;
        model
            .for_each_unit(&mut |_| {
                units += 1;
                Ok(())
            })
            .unwrap();
        let y = model.forward(
            &Tensor::from_vec(vec![0.01f32; 4 * 512], &[4, 512])?,
            &Context::train(),
        )?;
        Ok((y.shape().to_vec(), units))
    })?;
    println!("{:?} ({} FSDP units: 4 blocks + root)", out[0].0, out[0].1);
    Ok(())
}
