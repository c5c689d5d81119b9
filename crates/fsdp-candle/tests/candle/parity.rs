//! A candle MLP (SGD) and a small candle transformer (AdamW), 20 steps at world sizes 1, 2
//! and 4 under each sharding strategy, against the same model trained by the plain candle
//! loop on the whole global batch with candle_nn's optimizer: losses and final parameters
//! within 1e-6.

use crate::models::*;
use candle_nn::VarMap;
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{BackwardPrefetch, CpuOffload, FsdpConfig, ShardingStrategy};
use fsdp_candle::{CandleFsdp, Wrap};

const STEPS: usize = 20;

/// fsdp's config for `strategy` (hybrid: nodes of 2 ranks).
pub fn config(strategy: ShardingStrategy) -> FsdpConfig {
    FsdpConfig {
        sharding_strategy: strategy,
        ranks_per_node: strategy.is_hybrid().then_some(2),
        ..FsdpConfig::default()
    }
}

/// A config's strategy and the options set besides it, for messages.
fn label(c: &FsdpConfig) -> String {
    let mut s = format!("{:?}", c.sharding_strategy);
    if c.cpu_offload.offload_params {
        s += " cpu-offload";
    }
    if c.forward_prefetch {
        s += " forward-prefetch";
    }
    s
}

/// The rows of the global batch rank `r` of `w` trains on.
pub fn rows(r: usize, w: usize) -> (usize, usize) {
    (r * ROWS / w, (r + 1) * ROWS / w)
}

/// `run` through fsdp at `world` thread ranks with `cfg`, units by `wrap`.
pub fn sharded<M: 'static>(run: &Run<M>, world: usize, cfg: &FsdpConfig, wrap: &Wrap) -> Trained {
    let (build, loss, init, opt, steps) = (run.build, run.loss, run.init, run.opt, run.steps);
    let out = launch(&LaunchOptions::new(world), |pg| {
        let (lo, hi) = rows(pg.rank(), world);
        let mut m = CandleFsdp::from_varmap(build, init, wrap, pg, cfg.clone())?;
        let mut o = opt.fsdp();
        let mut losses = Vec::new();
        for s in 0..steps {
            losses.push(m.forward_backward(|model| loss(model, s, lo, hi))?);
            m.step(o.as_mut())?;
        }
        Ok((losses, values(&m.to_varmap()?)))
    })
    .unwrap();
    for (r, (_, p)) in out.iter().enumerate() {
        assert_eq!(
            p, &out[0].1,
            "rank {r}'s full parameters differ from rank 0's"
        );
    }
    let losses = (0..steps)
        .map(|s| (out.iter().map(|(l, _)| f64::from(l[s])).sum::<f64>() / world as f64) as f32)
        .collect();
    (losses, out[0].1.clone())
}

/// Checks a sharded run against the reference.
pub fn compare(what: &str, got: &Trained, want: &Trained, init: &VarMap) {
    assert_close(&format!("{what}: losses"), &got.0, &want.0, 1e-6);
    assert_eq!(
        got.1.keys().collect::<Vec<_>>(),
        want.1.keys().collect::<Vec<_>>()
    );
    let start = values(init);
    for (name, v) in &got.1 {
        assert_close(&format!("{what}: {name}"), v, &want.1[name], 1e-6);
        assert!(v != &start[name], "{what}: {name} did not train");
    }
    assert!(
        want.0[want.0.len() - 1] < want.0[0],
        "{what}: the loss did not go down"
    );
}

#[test]
fn an_mlp_trained_through_fsdp_equals_plain_candle_sgd() {
    let init = init(mlp);
    let run = mlp_sgd(&init, STEPS);
    let want = reference(&run);
    // layers.2 stays in the root unit.
    let wrap = Wrap::prefixes(["layers.0", "layers.1"]);
    let offload = FsdpConfig {
        cpu_offload: CpuOffload {
            offload_params: true,
        },
        ..config(ShardingStrategy::FullShard)
    };
    for (world, cfg) in [
        (1, config(ShardingStrategy::FullShard)),
        (2, config(ShardingStrategy::FullShard)),
        (2, offload),
        (2, config(ShardingStrategy::NoShard)),
        (4, config(ShardingStrategy::ShardGradOp)),
        (4, config(ShardingStrategy::HybridShard)),
    ] {
        let got = sharded(&run, world, &cfg, &wrap);
        compare(
            &format!("mlp {} world {world}", label(&cfg)),
            &got,
            &want,
            &init,
        );
    }
}

#[test]
fn a_transformer_trained_through_fsdp_equals_plain_candle_adamw() {
    let init = init(gpt);
    let run = Run {
        build: gpt,
        loss: gpt_loss,
        init: &init,
        opt: Opt::AdamW(3e-3),
        steps: STEPS,
    };
    let want = reference(&run);
    // Each block a unit; embeddings and the final LayerNorm in the root.
    let wrap = Wrap::modules(|p| p.starts_with("blocks.") && p.split('.').count() == 2);
    let prefetch = FsdpConfig {
        forward_prefetch: true,
        backward_prefetch: Some(BackwardPrefetch::BackwardPost),
        ..config(ShardingStrategy::FullShard)
    };
    for (world, cfg) in [
        (2, config(ShardingStrategy::ShardGradOp)),
        (4, prefetch),
        (4, config(ShardingStrategy::HybridShardZero2)),
        (2, config(ShardingStrategy::NoShard)),
    ] {
        let got = sharded(&run, world, &cfg, &wrap);
        compare(
            &format!("gpt {} world {world}", label(&cfg)),
            &got,
            &want,
            &init,
        );
    }
}
