//! Train a candle-nn MLP with its parameters, gradients and AdamW state sharded by fsdp.
//! Copy it: the model is plain candle (`new(vb)` and `forward`); only the training loop
//! changes (`CandleFsdp` instead of a `VarMap` and a candle optimizer).
//!
//! Ranks as threads of one process (`--world-size`, default 2):
//!     cargo run --release -p fsdp-candle --example train_mlp -- --world-size 4
//! Ranks as processes, one per rank, under the fsdp launcher (the `fsdp` binary):
//!     fsdp launch --nproc-per-node 2 -- target/release/examples/train_mlp --steps 50
//!
//! Options: `--steps N` (20), `--lr X` (0.01), `--strategy full-shard|shard-grad-op|
//! no-shard|hybrid-shard` (hybrid: nodes of 2 ranks), `--init FILE` (initial values, a
//! safetensors file of the vars; else candle's initializers on rank 0), `--out DIR`
//! (rank 0 writes `losses.txt` and the trained `params.safetensors`, candle var names).
//!
//! Data: a global batch of 16 rows per step, rows split evenly over the ranks (use a
//! world size that divides 16, so the mean of the ranks' losses is the global mean).

use candle::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use fsdp::distributed::{Group, ReduceOp};
use fsdp::fsdp::{FsdpConfig, ShardingStrategy};
use fsdp::optim::{AdamConfig, AdamW};
use fsdp_candle::{CandleFsdp, Wrap};
use std::path::PathBuf;

/// The model: `x (n, 8) -> 32 -> 32 -> 1`, ReLU between; vars `fc{0,1,2}.{weight,bias}`.
pub struct Mlp {
    fc: Vec<Linear>,
}

/// Layer widths.
const DIMS: [usize; 4] = [8, 32, 32, 1];

impl Mlp {
    /// The builder: candle's usual `new(vb)`.
    pub fn new(vb: VarBuilder) -> candle::Result<Mlp> {
        let fc = (0..3)
            .map(|i| linear(DIMS[i], DIMS[i + 1], vb.pp(format!("fc{i}"))))
            .collect::<candle::Result<_>>()?;
        Ok(Mlp { fc })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle::Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.fc.iter().enumerate() {
            h = l.forward(&h)?;
            if i + 1 < self.fc.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Rows in each step's global batch.
pub const BATCH: usize = 16;

/// Rows `lo..hi` of step `step`'s batch: `x (n, 8)` in [-1, 1] and the target
/// `y = sin(x0 + 2 x1) - x2 x3 (n, 1)`.
pub fn batch(step: usize, lo: usize, hi: usize) -> candle::Result<(Tensor, Tensor)> {
    let v = |k: usize| {
        let h = (step * 7919 + k).wrapping_mul(2654435761) % 2001;
        h as f32 / 1000.0 - 1.0
    };
    let x: Vec<f32> = (lo * DIMS[0]..hi * DIMS[0]).map(v).collect();
    let y: Vec<f32> = x
        .chunks(DIMS[0])
        .map(|r| (r[0] + 2.0 * r[1]).sin() - r[2] * r[3])
        .collect();
    let n = hi - lo;
    Ok((
        Tensor::from_vec(x, (n, DIMS[0]), &Device::Cpu)?,
        Tensor::from_vec(y, (n, 1), &Device::Cpu)?,
    ))
}

/// The options (see the module docs).
#[derive(Debug, Clone)]
pub struct Args {
    /// Thread ranks when not started by a launcher.
    pub world_size: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// AdamW's learning rate.
    pub lr: f32,
    /// fsdp's sharding strategy.
    pub strategy: ShardingStrategy,
    /// Initial values (safetensors, candle var names).
    pub init: Option<PathBuf>,
    /// Where rank 0 writes the losses and trained parameters.
    pub out: Option<PathBuf>,
}

impl Args {
    /// Parses `--flag value` pairs.
    pub fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
        let mut a = Args {
            world_size: 2,
            steps: 20,
            lr: 0.01,
            strategy: ShardingStrategy::FullShard,
            init: None,
            out: None,
        };
        while let Some(flag) = it.next() {
            let val = it.next().ok_or(format!("{flag} needs a value"))?;
            let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
            match flag.as_str() {
                "--world-size" => a.world_size = num(&val)?,
                "--steps" => a.steps = num(&val)?,
                "--lr" => a.lr = val.parse().map_err(|e| format!("--lr {val}: {e}"))?,
                "--init" => a.init = Some(val.into()),
                "--out" => a.out = Some(val.into()),
                "--strategy" => {
                    a.strategy = [
                        ShardingStrategy::FullShard,
                        ShardingStrategy::ShardGradOp,
                        ShardingStrategy::NoShard,
                        ShardingStrategy::HybridShard,
                    ]
                    .into_iter()
                    .find(|s| s.flag_name() == val)
                    .ok_or(format!("--strategy {val}: not a strategy"))?
                }
                _ => return Err(format!("unknown option {flag}")),
            }
        }
        Ok(a)
    }
}

/// Trains on one rank of `pg`; returns the global loss of each step (the mean over the
/// ranks) and, on every rank, the trained parameters.
pub fn train(pg: Group, args: &Args) -> fsdp_candle::Result<(Vec<f32>, VarMap)> {
    let (rank, world) = (pg.rank(), pg.size());
    let cfg = FsdpConfig {
        sharding_strategy: args.strategy,
        ranks_per_node: args.strategy.is_hybrid().then_some(2),
        ..FsdpConfig::default()
    };
    // Each layer its own unit (one FlatParameter, gathered and reduced on its own).
    let wrap = Wrap::prefixes(["fc0", "fc1", "fc2"]);
    let mut model = match &args.init {
        Some(file) => {
            let mut vm = VarMap::new();
            Mlp::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))
                .and_then(|_| vm.load(file))
                .map_err(|e| fsdp_candle::Error::Candle {
                    context: format!("loading {}", file.display()),
                    source: e,
                })?;
            CandleFsdp::from_varmap(Mlp::new, &vm, &wrap, pg.clone(), cfg)?
            // `vm` (the full values) is dropped here; the model holds its shards.
        }
        None => CandleFsdp::new(Mlp::new, &wrap, pg.clone(), cfg)?,
    };
    let mut opt = AdamW::new(AdamConfig {
        lr: args.lr,
        ..AdamConfig::adamw()
    });
    let (lo, hi) = (rank * BATCH / world, (rank + 1) * BATCH / world);
    let mut losses = Vec::new();
    for step in 0..args.steps {
        let (x, y) = batch(step, lo, hi).map_err(|e| fsdp_candle::Error::Candle {
            context: "making the batch".into(),
            source: e,
        })?;
        let loss = model.forward_backward(|m| candle_nn::loss::mse(&m.forward(&x)?, &y))?;
        model.step(&mut opt)?;
        // The global mean, for printing: the ranks' losses summed.
        let t = fsdp::tensor::Tensor::from_vec(vec![loss], &[1])?;
        pg.all_reduce(&t, ReduceOp::Sum)?;
        losses.push(t.to_vec_f32()?[0] / world as f32);
    }
    Ok((losses, model.to_varmap()?))
}

fn run(args: &Args, pg: Group) -> fsdp::Result<()> {
    let rank = pg.rank();
    let (losses, params) = train(pg, args)?;
    if rank != 0 {
        return Ok(());
    }
    for (s, l) in losses.iter().enumerate() {
        println!("step {s:3} loss {l:.6}");
    }
    if let Some(dir) = &args.out {
        let io = |e: std::io::Error| fsdp::Error::io(format!("writing to {}", dir.display()), e);
        std::fs::create_dir_all(dir).map_err(io)?;
        let lines: String = losses.iter().map(|l| format!("{l:?}\n")).collect();
        std::fs::write(dir.join("losses.txt"), lines).map_err(io)?;
        params
            .save(dir.join("params.safetensors"))
            .map_err(|e| fsdp::Error::Data(format!("saving the parameters: {e}")))?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            fsdp::distributed::record_message(&e, None);
            eprintln!("error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = if std::env::var_os("RANK").is_some() {
        // Started by a launcher (fsdp launch, torchrun): one process per rank, meeting over
        // TCP at MASTER_ADDR:MASTER_PORT.
        fsdp::distributed::init_process_group(fsdp::distributed::InitOptions::new("tcp"))
            .and_then(|pg| run(&args, pg))
            .inspect_err(|e| {
                fsdp::distributed::record_error(e);
            })
    } else {
        fsdp::distributed::launch(
            &fsdp::distributed::LaunchOptions::new(args.world_size),
            |pg| run(&args, pg),
        )
        .map(drop)
    };
    fsdp::exit_code(result)
}
