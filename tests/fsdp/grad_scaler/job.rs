//! `fsdp train` under the grad scaler: a forced overflow, bf16 and f32 unscaled, resume,
//! bad options, and what scaling does to f16 gradients.

use crate::common::{self, corpus_file, small_job};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::ShardingStrategy;
use fsdp::nn::{loss, Context};
use fsdp::tensor::Tensor;
use fsdp::train::{train, Precision, Silent, TrainConfig, TrainReport};
use std::path::PathBuf;

fn run_job(cfg: &TrainConfig) -> TrainReport {
    train(cfg, &Silent).unwrap_or_else(|e| panic!("{cfg:?}: {e}"))
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-scaler-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_forced_overflow_skips_steps_then_trains() {
    let data = corpus_file("scaler-overflow");
    let job = |steps, save_dir: Option<PathBuf>| TrainConfig {
        mixed_precision: Precision::F16,
        init_scale: 2f32.powi(40),
        strategy: ShardingStrategy::HybridShard,
        ranks_per_node: Some(2),
        steps,
        save_dir,
        checkpoint_type: fsdp::train::CheckpointType::Full,
        ..small_job(data.clone(), 4)
    };
    let r = run_job(&job(60, None));
    let skipped: Vec<usize> = r
        .records
        .iter()
        .filter(|x| x.skipped)
        .map(|x| x.step)
        .collect();
    // 2^40 down to 2^16 are beyond f16 (65504): the f16 loss's gradient is infinite at
    // each (as in PyTorch, whose f16 loss takes the scale as an f16 gradient), so at least
    // those 25 steps are skipped, one after the other, the scale halving each time.
    let first_trained = r.records.iter().position(|x| !x.skipped).unwrap();
    assert!(first_trained >= 25, "skipped {skipped:?}");
    for (k, rec) in r.records[..first_trained].iter().enumerate() {
        assert_eq!(
            rec.loss_scale,
            Some(2f32.powi(40 - k as i32)),
            "step {}",
            rec.step
        );
    }
    let scale_then = r.records[first_trained].loss_scale.unwrap();
    assert!(scale_then <= 32768.0, "{scale_then}");
    // Then it trains: few more skips, and the loss falls.
    assert!(skipped.len() <= first_trained + 3, "skipped {skipped:?}");
    let l0 = r.records[first_trained].loss;
    let tail: f32 = r.losses()[55..].iter().sum::<f32>() / 5.0;
    eprintln!(
        "skipped {} steps {skipped:?}; scale 2^40 -> {scale_then} at step {}; loss {l0} -> {tail} (last 5)",
        skipped.len(),
        first_trained + 1
    );
    assert!(tail < l0 - 0.5, "loss did not fall: {:?}", r.losses());

    // The skipped steps changed nothing: a checkpoint after the first 25 holds the initial
    // model (deferred init equals the unsharded model's), an optimizer that never stepped
    // and the scale backed off 25 times. Every rank took part alike: a rank that had
    // stepped would have moved its shard.
    let dir = tmp_dir("overflow");
    let cfg = job(25, Some(dir.clone()));
    let saved = run_job(&cfg);
    assert!(saved.records.iter().all(|x| x.skipped));
    let ckpt = dir.join("step-00000025");
    let index = fsdp::checkpoint::read_index(&ckpt).unwrap();
    let model_file = index
        .files
        .iter()
        .find(|f| f.name.starts_with("model-"))
        .unwrap();
    let sd = fsdp::checkpoint::load_state_dict_file(&ckpt.join(&model_file.name)).unwrap();
    let mut init = fsdp::nn::GPT::new(cfg.gpt_config(), cfg.seed).unwrap();
    let want = common::named_values(&mut init);
    assert_eq!(sd.tensors.len(), want.len());
    for (name, v) in &want {
        let got = sd.tensors.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!(
            &got.1.to_vec_f32().unwrap(),
            v,
            "{name} moved during skipped steps"
        );
    }
    let optim = index.optim.unwrap();
    assert!(optim.steps.values().all(|&s| s == 0), "{:?}", optim.steps);
    let info = fsdp::checkpoint::read_checkpoint_info(&ckpt).unwrap();
    let state = info.grad_scaler_state().unwrap().unwrap();
    assert_eq!((state.scale, state.growth_tracker), (32768.0, 0));
}

#[test]
fn bf16_and_f32_stay_unscaled_and_f16_scales_by_default() {
    let data = corpus_file("scaler-bf16");
    let base = |p| TrainConfig {
        mixed_precision: p,
        steps: 6,
        ..small_job(data.clone(), 2)
    };
    for p in [Precision::Bf16, Precision::None] {
        let asked = TrainConfig {
            grad_scaler: Some(true),
            ..base(p)
        };
        assert!(!asked.uses_grad_scaler());
        let w = asked.grad_scaler_warning().unwrap();
        let name = if p == Precision::Bf16 { "bf16" } else { "f32" };
        assert!(w.contains("--grad-scaler") && w.contains(name), "{w}");
        assert_eq!(base(p).grad_scaler_warning(), None);
        let (a, b) = (run_job(&base(p)), run_job(&asked));
        // The same numbers bit for bit, and no scale recorded.
        assert_eq!(a.losses(), b.losses(), "{p:?}");
        assert!(b
            .records
            .iter()
            .all(|r| r.loss_scale.is_none() && !r.skipped));
    }
    let f16 = base(Precision::F16);
    assert!(f16.uses_grad_scaler() && f16.grad_scaler_warning().is_none());
    let r = run_job(&f16);
    assert_eq!(r.records[0].loss_scale, Some(65536.0));
    // As in PyTorch, 2^16 is beyond f16: the first step overflows and backs off.
    assert!(r.records[0].skipped && r.records[1].loss_scale == Some(32768.0));
    let json = serde_json::to_value(&r.records[0]).unwrap();
    assert_eq!(json["loss_scale"], 65536.0);
    assert_eq!(json["skipped"], true);
    let json = serde_json::to_value(&r.records[1]).unwrap();
    assert!(
        json.get("skipped").is_none(),
        "written only when true: {json}"
    );
    let off = run_job(&TrainConfig {
        grad_scaler: Some(false),
        ..f16
    });
    assert!(off.records.iter().all(|r| r.loss_scale.is_none()));
}

#[test]
fn resume_goes_on_with_the_checkpoints_scale_and_growth_tracker() {
    let data = corpus_file("scaler-resume");
    let save = tmp_dir("resume");
    let job = |steps| TrainConfig {
        mixed_precision: Precision::F16,
        init_scale: 2f32.powi(17),
        growth_interval: 3,
        steps,
        ..small_job(data.clone(), 2)
    };
    // The scale cycles: 2^17 and 2^16 overflow (beyond f16, as the f16 loss's gradient),
    // 2^15 trains 3 steps, grows to 2^16, which overflows, ... After step 7 the tracker
    // counts 1 clean step.
    let full = TrainConfig {
        save_dir: Some(save.clone()),
        save_every: 7,
        keep_last: 3,
        ..job(18)
    };
    let base = run_job(&full);
    let ckpt = save.join("step-00000007");
    let state = fsdp::checkpoint::read_checkpoint_info(&ckpt)
        .unwrap()
        .grad_scaler_state()
        .unwrap()
        .unwrap();
    // The checkpoint is mid-interval (a tracker of 0 would not show that it is restored).
    assert_eq!(Some(state.scale), base.records[7].loss_scale);
    assert_ne!(state.growth_tracker, 0, "{state:?}; {:?}", base.records);
    let resumed = run_job(&TrainConfig {
        resume: Some(ckpt.clone()),
        ..job(18)
    });
    assert_eq!(resumed.records.len(), 11);
    for (r, b) in resumed.records.iter().zip(&base.records[7..]) {
        assert_eq!(
            (r.step, r.loss_scale, r.skipped, r.loss),
            (b.step, b.loss_scale, b.skipped, b.loss)
        );
    }
    // Resuming a scaled run unscaled, or an unscaled one scaled, is refused naming it.
    let err = train(
        &TrainConfig {
            resume: Some(ckpt),
            grad_scaler: Some(false),
            ..job(18)
        },
        &Silent,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("pass the checkpoint's values: the grad scaler, at scale ")
            && err.contains(
                "(this run: none; it is on under --mixed-precision f16 without --no-grad-scaler)"
            ),
        "{err}"
    );
    let unscaled = tmp_dir("resume-unscaled");
    run_job(&TrainConfig {
        save_dir: Some(unscaled.clone()),
        grad_scaler: Some(false),
        ..job(3)
    });
    let err = train(
        &TrainConfig {
            resume: Some(unscaled),
            ..job(6)
        },
        &Silent,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("pass the checkpoint's values: --no-grad-scaler (this run: the grad scaler, on under --mixed-precision f16; the checkpoint's run trained unscaled)"),
        "{err}"
    );
}

#[test]
fn bad_scaler_options_are_refused_naming_them() {
    let data = corpus_file("scaler-options");
    for (cfg, flag) in [
        (
            TrainConfig {
                init_scale: 0.0,
                ..small_job(data.clone(), 1)
            },
            "--init-scale",
        ),
        (
            TrainConfig {
                init_scale: f32::INFINITY,
                ..small_job(data.clone(), 1)
            },
            "--init-scale",
        ),
        (
            TrainConfig {
                growth_interval: 0,
                ..small_job(data.clone(), 1)
            },
            "--growth-interval",
        ),
    ] {
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(flag), "{err}");
    }
}

/// The gradients of one batch of the small job (world size 1, at its initial parameters)
/// in `p`, with the loss scaled by `g` and the gradients divided by it again.
fn job_gradients(data: &std::path::Path, p: Precision, g: f32) -> Vec<f32> {
    use fsdp::train::data::{Split, TextDataset};
    let cfg = TrainConfig {
        mixed_precision: p,
        global_batch: 32,
        ..small_job(data.to_path_buf(), 1)
    };
    let ds = TextDataset::load(&cfg.data, cfg.seq_len).unwrap();
    launch(&LaunchOptions::new(1), |pg| {
        let mut e = fsdp::train::build_engine(&cfg, pg)?;
        let (x, y) = ds.batch(Split::Train, cfg.seed, 1, 0..cfg.global_batch, cfg.seq_len);
        let x = Tensor::from_vec(x, &[cfg.global_batch, cfg.seq_len])?;
        let y = Tensor::from_vec(y, &[cfg.global_batch, cfg.seq_len])?;
        let logits = e.module().forward(&x, &Context::train())?;
        let (_, dy) = loss::cross_entropy_tensor_scaled(&logits, &y, g)?;
        e.backward(&dy, false)?;
        let mut out = Vec::new();
        for p in e.optimizer_params() {
            out.extend(p.grad.unwrap().to_vec_f32()?.iter().map(|v| v / g));
        }
        Ok(out)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn scaled_f16_gradients_lose_nothing_to_underflow_and_are_closer_to_f32() {
    // What the scaler is for, on the main job's model: unscaled, some f16 gradients
    // underflow to zero where f32's are not (measured: 11 of 34,176 here; 110 of 834,304
    // for the default job's model on tinyshakespeare); scaled by 2^15, none do, and the
    // whole gradient is closer to f32's (relative error 4.34e-4 against 4.52e-4 here;
    // 2.00e-3 against 2.17e-3 on the default job).
    let data = corpus_file("scaler-underflow");
    let g32 = job_gradients(&data, Precision::None, 1.0);
    let norm = g32
        .iter()
        .map(|v| f64::from(*v).powi(2))
        .sum::<f64>()
        .sqrt();
    let measure = |g: &[f32]| {
        let err = g
            .iter()
            .zip(&g32)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>();
        let lost = g
            .iter()
            .zip(&g32)
            .filter(|(a, b)| **a == 0.0 && **b != 0.0)
            .count();
        (err.sqrt() / norm, lost)
    };
    let (err_u, lost_u) = measure(&job_gradients(&data, Precision::F16, 1.0));
    let (err_s, lost_s) = measure(&job_gradients(&data, Precision::F16, 32768.0));
    eprintln!("unscaled: rel err {err_u:.3e}, {lost_u} underflowed; scaled: {err_s:.3e}, {lost_s}");
    assert!(
        lost_u > 0 && lost_s == 0,
        "underflowed: unscaled {lost_u}, scaled {lost_s}"
    );
    assert!(
        err_s < err_u,
        "relative error scaled {err_s} vs unscaled {err_u}"
    );
}
