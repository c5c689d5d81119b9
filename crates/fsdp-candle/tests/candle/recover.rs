//! A bad loss on one rank (not a scalar, detached from the vars, a constant, the closure's
//! own error) is found before any collective of the backward: every rank gets the same
//! `PassFailed` naming that rank and its error, nothing changes, and training goes on as
//! if the step had been skipped. A failure inside the collectives stays fatal.

use crate::guards::{err, has, mlp_model};
use crate::models::*;
use crate::parity::{config, rows};
use candle::{Device, Tensor};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::ShardingStrategy;
use fsdp_candle::{CandleFsdp, Wrap};

/// What the bad rank's closure returns at the bad step.
#[derive(Debug, Clone, Copy)]
enum Bad {
    /// The model's output `(n, 3)`: not a scalar.
    NotScalar,
    /// The right loss, detached: no gradient path to any var.
    Detached,
    /// A constant computed without the model.
    Constant,
    /// The closure's own error.
    Err,
}

impl Bad {
    fn loss(self, m: &Mlp, s: usize, lo: usize, hi: usize) -> candle::Result<Tensor> {
        match self {
            Bad::NotScalar => m.forward(&mlp_batch(s, lo, hi).0),
            Bad::Detached => Ok(mlp_loss(m, s, lo, hi)?.detach()),
            Bad::Constant => Tensor::new(1.5f32, &Device::Cpu),
            Bad::Err => Err(candle::Error::Msg("no batch for this step".into())),
        }
    }

    /// What every rank's error says about the bad rank's.
    fn message(self, rows: usize) -> String {
        match self {
            Bad::NotScalar => format!("the closure returned a loss of shape [{rows}, 3]"),
            Bad::Detached | Bad::Constant => "the loss depends on no var of the model".into(),
            Bad::Err => "the forward/loss closure: no batch for this step".into(),
        }
    }
}

const STEPS: usize = 5;
/// The step at which one rank's loss is bad.
const BAD_STEP: usize = 2;

#[test]
fn a_bad_loss_on_one_rank_skips_the_step_on_every_rank_and_training_goes_on() {
    let init = init(mlp);
    let run = mlp_sgd(&init, STEPS);
    let (want_losses, want) = reference_skipping(&run, Some(BAD_STEP));
    // Skipping the step matters: the run without the skip ends elsewhere.
    let (_, all_steps) = reference(&run);
    assert!(want != all_steps);
    let wrap = Wrap::prefixes(["layers.0", "layers.1"]);
    for (world, bad_rank, bad, strategy) in [
        (1, 0, Bad::NotScalar, ShardingStrategy::FullShard),
        (2, 1, Bad::NotScalar, ShardingStrategy::FullShard),
        (2, 0, Bad::Detached, ShardingStrategy::NoShard),
        (4, 3, Bad::Err, ShardingStrategy::ShardGradOp),
        (4, 2, Bad::Constant, ShardingStrategy::HybridShard),
    ] {
        let what = format!("world {world}, {bad:?} on rank {bad_rank}, {strategy:?}");
        let out = launch(&LaunchOptions::new(world), |pg| {
            let (r, (lo, hi)) = (pg.rank(), rows(pg.rank(), world));
            let mut m = CandleFsdp::from_varmap(mlp, &init, &wrap, pg, config(strategy))?;
            let mut o = Opt::Sgd(0.1).fsdp();
            let (mut losses, mut errors) = (Vec::new(), Vec::new());
            for s in 0..STEPS {
                let pass = m.forward_backward(|model| match s == BAD_STEP && r == bad_rank {
                    true => bad.loss(model, s, lo, hi),
                    false => mlp_loss(model, s, lo, hi),
                });
                match pass {
                    Ok(l) => {
                        losses.push(l);
                        m.step(o.as_mut())?;
                    }
                    Err(e @ fsdp_candle::Error::PassFailed { .. }) => {
                        // Nothing to step on.
                        errors.push((s, e.to_string(), err(m.step(o.as_mut()))));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Ok((losses, errors, values(&m.to_varmap()?)))
        })
        .unwrap();
        let bad_rows = rows(bad_rank, world);
        for (r, (losses, errors, got)) in out.iter().enumerate() {
            assert_eq!(errors.len(), 1, "{what}: rank {r}: {errors:?}");
            let (s, e, step) = &errors[0];
            assert_eq!(*s, BAD_STEP, "{what}: rank {r}");
            has(
                e,
                &format!("the training pass failed on rank(s) [{bad_rank}] before the backward's collectives"),
            );
            has(
                e,
                &format!(
                    "rank {bad_rank}{}: ",
                    if r == bad_rank { " (this rank)" } else { "" }
                ),
            );
            has(e, &bad.message(bad_rows.1 - bad_rows.0));
            has(step, "step: no gradients since the last step");
            assert_eq!(losses.len(), STEPS - 1, "{what}: rank {r}");
            for (name, v) in got {
                assert_close(&format!("{what}: rank {r}: {name}"), v, &want[name], 1e-6);
            }
        }
        // The losses of the steps run: the mean over the ranks, as the global batch's.
        let mean: Vec<f32> = (0..STEPS - 1)
            .map(|i| (out.iter().map(|o| f64::from(o.0[i])).sum::<f64>() / world as f64) as f32)
            .collect();
        assert_close(&format!("{what}: losses"), &mean, &want_losses, 1e-6);
    }
}

#[test]
fn a_failed_micro_batch_keeps_the_gradients_of_the_earlier_ones() {
    let init = init(mlp);
    let (_, want) = reference(&mlp_sgd(&init, 3));
    let out = launch(&LaunchOptions::new(2), |pg| {
        let (r, (lo, hi)) = (pg.rank(), rows(pg.rank(), 2));
        // Shard-grad-op keeps the units' parameters gathered from the forward to the
        // backward: the failed pass must free them, or step 2 would run on step 0's values.
        let wrap = Wrap::prefixes(["layers.0", "layers.1"]);
        let cfg = config(ShardingStrategy::ShardGradOp);
        let mut m = CandleFsdp::from_varmap(mlp, &init, &wrap, pg, cfg)?;
        let mut o = Opt::Sgd(0.1).fsdp();
        let mut e = Vec::new();
        for s in 0..3 {
            // Step 1's first micro-batch is the whole batch; a second one fails on rank 0
            // and adds nothing.
            m.forward_backward_accumulate(|model| mlp_loss(model, s, lo, hi))?;
            if s == 1 {
                e.push(err(m.forward_backward_accumulate(|model| match r {
                    0 => Bad::Err.loss(model, s, lo, hi),
                    _ => mlp_loss(model, s, lo, hi),
                })));
            }
            m.step(o.as_mut())?;
        }
        Ok((e, values(&m.to_varmap()?)))
    })
    .unwrap();
    for (e, got) in &out {
        has(&e[0], "rank 0");
        has(&e[0], "no batch for this step");
        for (name, v) in got {
            assert_close(name, v, &want[name], 1e-6);
        }
    }
}

#[test]
fn a_failure_inside_the_collectives_fails_every_rank_at_once() {
    let init = init(mlp);
    // Rank 1's world is aborted before its pass: rank 0, already in the gathers, fails at
    // once with the abort instead of waiting for the timeout, and neither model can be
    // used afterwards.
    let out = launch(&LaunchOptions::new(2), |pg| {
        let (r, (lo, hi)) = (pg.rank(), rows(pg.rank(), 2));
        let mut m = mlp_model(pg.clone(), &init)?;
        if r == 1 {
            pg.abort("rank 1 gave up");
        }
        let e = err(m.forward_backward(|model| mlp_loss(model, 0, lo, hi)));
        let after = err(m.forward_backward(|model| mlp_loss(model, 0, lo, hi)));
        Ok((e, after))
    })
    .unwrap();
    for (e, after) in &out {
        has(e, "rank 1 gave up");
        has(
            after,
            "the model failed earlier and cannot be used: forward_backward after",
        );
    }
}
