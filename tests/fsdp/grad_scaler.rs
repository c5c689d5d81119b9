//! `ShardedGradScaler` (issue 28, point 2): dynamic loss scaling for f16.
//!
//! - Parity with PyTorch 2.11's `ShardedGradScaler` driving FSDP1 (f16 compute, 12 steps
//!   of a small MLP at world sizes 1, 2 and hybrid 2 x 2, SGD and Adam, clipping after
//!   `unscale_`): the scale sequence, the skipped steps and the scaler's state exactly, the
//!   parameters within the f16 tolerance below, against
//!   `tests/torch_ref/grad_scaler_refs.json` (`tests/torch_ref/make_grad_scaler_refs.py`).
//!   The same run without the found-inf all-reduce differs from it: the reference has
//!   steps where only some ranks' shards overflowed.
//! - `fsdp train --mixed-precision f16` with a scale forced to overflow (2^40): the
//!   first steps are skipped with the scale halving each time, the model and optimizer
//!   untouched by them, then the run trains.
//! - bf16 (and f32) stay unscaled, with a warning when a scaler is asked for.
//! - A resumed run goes on with the checkpoint's scale and growth tracker.
//! - The scaler's misuse errors, and the unscale op on every dtype.
//!
//! | file | tests |
//! |---|---|
//! | `grad_scaler/torch.rs` | the PyTorch parity, with and without the all-reduce |
//! | `grad_scaler/job.rs` | `fsdp train`: forced overflow, bf16/f32, resume, options, underflow |
//! | this file | the scaler's API and errors, the unscale op, the scaled losses |

use crate::device;
use crate::device_test;
mod job;
mod torch;

use fsdp::fsdp::{GradScalerConfig, GradScalerState, ShardedGradScaler};
use fsdp::nn::loss;
use fsdp::optim::{ParamGrad, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};

/// One parameter `[1, 2]` with gradient `g`, and an SGD (lr 1) over it.
fn one_param(g: Vec<f32>) -> (Vec<ParamGrad>, SGD) {
    let p = ParamGrad {
        param: Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap(),
        grad: Some(Tensor::from_vec(g, &[2]).unwrap()),
    };
    let opt = SGD::new(SgdConfig {
        lr: 1.0,
        ..Default::default()
    });
    (vec![p], opt)
}

#[test]
fn step_unscales_skips_on_inf_and_update_moves_the_scale() {
    let cfg = GradScalerConfig {
        init_scale: 8.0,
        growth_interval: 2,
        ..Default::default()
    };
    let mut s = ShardedGradScaler::new(cfg, None).unwrap();
    assert_eq!((s.get_scale(), s.growth_tracker()), (8.0, 0));
    // A clean step: the gradient is divided by 8 and the parameter moves by it.
    assert_eq!(s.loss_grad_output(), 8.0);
    let (params, mut opt) = one_param(vec![8.0, -16.0]);
    assert!(s.step(&mut opt, &params).unwrap());
    assert_eq!(
        params[0].grad.as_ref().unwrap().to_vec_f32().unwrap(),
        [1.0, -2.0]
    );
    assert_eq!(params[0].param.to_vec_f32().unwrap(), [0.0, 4.0]);
    s.update().unwrap();
    assert_eq!((s.get_scale(), s.growth_tracker()), (8.0, 1));
    // Inf: no step, the scale halves, the tracker resets.
    s.loss_grad_output();
    let (params, mut opt) = one_param(vec![f32::INFINITY, 1.0]);
    assert!(!s.step(&mut opt, &params).unwrap());
    assert_eq!(params[0].param.to_vec_f32().unwrap(), [1.0, 2.0]);
    s.update().unwrap();
    assert_eq!((s.get_scale(), s.growth_tracker()), (4.0, 0));
    // NaN counts too; then two clean steps double the scale.
    let (params, mut opt) = one_param(vec![f32::NAN, 1.0]);
    s.unscale_(&opt, &params).unwrap();
    assert!(!s.step(&mut opt, &params).unwrap());
    s.update().unwrap();
    assert_eq!(s.get_scale(), 2.0);
    for _ in 0..2 {
        let (params, mut opt) = one_param(vec![1.0, 1.0]);
        assert!(s.step(&mut opt, &params).unwrap());
        s.update().unwrap();
    }
    assert_eq!((s.get_scale(), s.growth_tracker()), (4.0, 0));
    // state_dict / load_state_dict, with PyTorch's keys.
    let st = s.state_dict().unwrap();
    let json = serde_json::to_value(st).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": 2, "_growth_tracker": 0})
    );
    let mut t = ShardedGradScaler::new(GradScalerConfig::default(), None).unwrap();
    t.load_state_dict(Some(&st)).unwrap();
    assert_eq!(t.state_dict(), Some(st));
}

#[test]
fn misuse_is_refused_as_pytorch_refuses_it() {
    let err = |r: fsdp::Result<()>| r.unwrap_err().to_string();
    let mut s = ShardedGradScaler::new(GradScalerConfig::default(), None).unwrap();
    let (params, mut opt) = one_param(vec![1.0, 1.0]);
    // Before the loss was ever scaled.
    assert!(err(s.unscale_(&opt, &params)).contains("before the loss was ever scaled"));
    s.loss_grad_output();
    assert!(err(s.update()).contains("no inf checks were recorded"));
    s.unscale_(&opt, &params).unwrap();
    assert!(err(s.unscale_(&opt, &params)).contains("already been called on this optimizer"));
    s.step(&mut opt, &params).unwrap();
    assert!(err(s.step(&mut opt, &params).map(drop))
        .contains("already been called since the last update"));
    assert!(err(s.unscale_(&opt, &params)).contains("after step()"));
    s.update().unwrap();
    // A second optimizer has its own record within an iteration.
    let (params2, opt2) = one_param(vec![1.0, 1.0]);
    s.unscale_(&opt, &params).unwrap();
    s.unscale_(&opt2, &params2).unwrap();
    // Bad configurations and states.
    for (c, what) in [
        (
            GradScalerConfig {
                growth_factor: 1.0,
                ..Default::default()
            },
            "growth_factor",
        ),
        (
            GradScalerConfig {
                backoff_factor: 1.0,
                ..Default::default()
            },
            "backoff_factor",
        ),
        (
            GradScalerConfig {
                growth_interval: 0,
                ..Default::default()
            },
            "growth_interval",
        ),
        (
            GradScalerConfig {
                init_scale: f32::NAN,
                ..Default::default()
            },
            "init_scale",
        ),
    ] {
        let e = ShardedGradScaler::new(c, None).unwrap_err().to_string();
        assert!(e.contains(what), "{e}");
    }
    assert!(err(s.load_state_dict(None)).contains("empty"));
    let bad = GradScalerState {
        scale: 8.0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 4,
        growth_tracker: 4,
    };
    assert!(err(s.load_state_dict(Some(&bad))).contains("_growth_tracker 4"));
    // Disabled: the optimizer steps, everything else is a no-op.
    let off = GradScalerConfig {
        enabled: false,
        growth_factor: 0.0,
        ..Default::default()
    };
    let mut d = ShardedGradScaler::new(off, None).unwrap();
    assert_eq!(d.loss_grad_output(), 1.0);
    let (params, mut opt) = one_param(vec![f32::INFINITY, 1.0]);
    d.unscale_(&opt, &params).unwrap();
    assert!(d.step(&mut opt, &params).unwrap());
    d.update().unwrap();
    assert_eq!((d.state_dict(), d.get_scale()), (None, 1.0));
    d.load_state_dict(None).unwrap();
}

device_test!(unscale_op_checks_and_divides_every_dtype, |dev| {
    use fsdp::ops::non_finite_check_and_unscale_ as unscale;
    let t = |v: Vec<f32>, d: DType| {
        let h = Tensor::from_vec(v, &[2]).unwrap().to_dtype(d).unwrap();
        h.to_device(dev).unwrap()
    };
    for d in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        let a = t(vec![4.0, -8.0], d);
        let b = t(vec![2.0, 1.0], d);
        assert!(!unscale(&[&a, &b], 0.25).unwrap(), "{d:?}");
        assert_eq!(a.to_vec_f32().unwrap(), [1.0, -2.0], "{d:?}");
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let c = t(vec![1.0, bad], d);
            assert!(unscale(&[&a, &c], 0.5).unwrap(), "{d:?} {bad}");
            // Everything is divided whatever it holds, as PyTorch's op.
            assert_eq!(c.to_vec_f32().unwrap()[0], 0.5);
        }
    }
    // A finite value that the factor pushes past f32 is not an overflow of the gradients.
    let big = t(vec![f32::MAX, 1.0], DType::F32);
    assert!(!unscale(&[&big], 4.0).unwrap());
    assert!(!unscale(&[], 0.5).unwrap());
    // Tensors on two devices in one call (CPU offload's host shards beside device ones).
    let host = Tensor::from_vec(vec![f32::NAN, 1.0], &[2]).unwrap();
    let on_dev = t(vec![2.0, 4.0], DType::F32);
    assert!(unscale(&[&on_dev, &host], 0.5).unwrap());
    assert_eq!(on_dev.to_vec_f32().unwrap(), [1.0, 2.0]);
    let ids = Tensor::from_vec(vec![1i32, 2], &[2]).unwrap();
    assert!(unscale(&[&ids], 0.5).is_err());
    Ok(())
});

device_test!(scaled_losses_carry_the_scale_into_the_gradient, |dev| {
    let v = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
    let logits = device::tensor_on(v, &[3, 4], dev);
    let y = device::ids_on(vec![1i32, 3, 0], &[3], dev);
    let (l1, g1) = loss::cross_entropy_tensor(&logits, &y).unwrap();
    let (l8, g8) = loss::cross_entropy_tensor_scaled(&logits, &y, 8.0).unwrap();
    assert_eq!(l1.to_vec_f32().unwrap(), l8.to_vec_f32().unwrap());
    let want: Vec<f32> = g1.to_vec_f32().unwrap().iter().map(|v| v * 8.0).collect();
    assert_eq!(g8.to_vec_f32().unwrap(), want);
    // f16 logits: the scale enters before the f16 rounding; 2^16 is beyond f16.
    let h = logits.to_dtype(DType::F16).unwrap();
    let (_, g) = loss::cross_entropy_tensor_scaled(&h, &y, 65536.0).unwrap();
    assert!(g.to_vec_f32().unwrap().iter().all(|v| !v.is_finite()));
    let (_, g1) = loss::cross_entropy_tensor_scaled(&h, &y, 1.0).unwrap();
    let (_, g0) = loss::cross_entropy_tensor(&h, &y).unwrap();
    assert_eq!(g1.to_vec_f32().unwrap(), g0.to_vec_f32().unwrap());
    // What the scale is for: a gradient below f16's normal range loses its digits
    // unscaled and keeps them scaled. d(mse)/dp = 2 (p - t) / 2 = 3 * 2^-26, which f16
    // rounds to 2^-24 (its subnormal spacing); times 2^10 it is 3 * 2^-16, exact in f16.
    let p = device::tensor_on(vec![0.0625f32, 1.0], &[2], dev).to_dtype(DType::F16)?;
    let t = device::tensor_on(vec![0.0625f32 - 3.0 * 2f32.powi(-26), 1.0], &[2], dev);
    let (_, unscaled) = loss::mse_loss(&p, &t).unwrap();
    let (_, scaled) = loss::mse_loss_scaled(&p, &t, 1024.0).unwrap();
    assert_eq!(unscaled.to_vec_f32().unwrap()[0], 2f32.powi(-24));
    assert_eq!(scaled.to_vec_f32().unwrap()[0], 3.0 * 2f32.powi(-16));
    let big = device::tensor_on(vec![0.5f32, 0.25], &[2], dev);
    let q = device::tensor_on(vec![1.0f32, 1.0], &[2], dev);
    let (_, m1) = loss::mse_loss(&big, &q).unwrap();
    let (_, m4) = loss::mse_loss_scaled(&big, &q, 4.0).unwrap();
    let want: Vec<f32> = m1.to_vec_f32().unwrap().iter().map(|v| v * 4.0).collect();
    assert_eq!(m4.to_vec_f32().unwrap(), want);
    Ok(())
});
