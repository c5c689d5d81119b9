#![allow(clippy::excessive_precision)] // the references are torch's values as printed
//! SGD, Adam and AdamW against values computed by `torch.optim` (torch 2.11.0, CPU, f32):
//! three steps on the same 5-element parameter with fixed gradients.
//!
//! The reference script: p = [0.5, -1.25, 2.0, 0.0, -0.3]; grads per step
//! [0.1, -0.2, 0.3, 0.0, 1.5], [-0.05, 0.4, 0.1, 0.2, -1.0], [0.3, 0.3, -0.2, -0.1, 0.5];
//! `p.grad = g; opt.step()` for each.

use crate::common;

use fsdp::optim::{Adam, AdamConfig, AdamW, Optimizer, ParamGrad, SgdConfig, SGD};
use fsdp::tensor::Tensor;

const P0: [f32; 5] = [0.5, -1.25, 2.0, 0.0, -0.3];
const GRADS: [[f32; 5]; 3] = [
    [0.1, -0.2, 0.3, 0.0, 1.5],
    [-0.05, 0.4, 0.1, 0.2, -1.0],
    [0.3, 0.3, -0.2, -0.1, 0.5],
];

fn run(opt: &mut dyn Optimizer) -> Vec<f32> {
    let p = Tensor::from_vec(P0.to_vec(), &[5]).unwrap();
    for g in GRADS {
        let grad = Tensor::from_vec(g.to_vec(), &[5]).unwrap();
        opt.step(&[ParamGrad {
            param: p.clone(),
            grad: Some(grad),
        }])
        .unwrap();
    }
    p.to_vec_f32().unwrap()
}

fn check(name: &str, opt: &mut dyn Optimizer, torch: [f32; 5]) {
    common::assert_close(name, &run(opt), &torch, 2e-7, 2e-6);
}

#[test]
fn sgd_matches_torch() {
    check(
        "sgd lr 0.1",
        &mut SGD::new(SgdConfig {
            lr: 0.1,
            ..Default::default()
        }),
        [
            0.465000004,
            -1.29999995,
            1.98000002,
            -0.0100000007,
            -0.400000036,
        ],
    );
    check(
        "sgd momentum 0.9 dampening 0.1 wd 0.01",
        &mut SGD::new(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            nesterov: false,
        }),
        [
            0.451822251,
            -1.28459132,
            1.90907919,
            -0.0251837987,
            -0.578473389,
        ],
    );
    check(
        "sgd nesterov",
        &mut SGD::new(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.01,
            nesterov: true,
        }),
        [
            0.418227315,
            -1.33663762,
            1.89200473,
            -0.0351277962,
            -0.636256814,
        ],
    );
}

#[test]
fn adam_matches_torch() {
    check(
        "adam lr 0.01",
        &mut Adam::new(AdamConfig {
            lr: 0.01,
            ..AdamConfig::adam()
        }),
        [
            0.48063162,
            -1.24957097,
            1.97901714,
            -0.00972777046,
            -0.314230293,
        ],
    );
    check(
        "adam wd 0.1 betas (0.8, 0.9)",
        &mut Adam::new(AdamConfig {
            lr: 0.01,
            weight_decay: 0.1,
            betas: (0.8, 0.9),
            ..AdamConfig::adam()
        }),
        [
            0.475586325,
            -1.24325657,
            1.97338593,
            -0.00951802358,
            -0.312947005,
        ],
    );
}

#[test]
fn adamw_matches_torch() {
    check(
        "adamw defaults lr 0.01",
        &mut AdamW::new(AdamConfig {
            lr: 0.01,
            ..AdamConfig::adamw()
        }),
        [
            0.48048389,
            -1.2491976,
            1.97842002,
            -0.00972702634,
            -0.314138144,
        ],
    );
    check(
        "adamw wd 0.1 eps 1e-6",
        &mut AdamW::new(AdamConfig {
            lr: 0.01,
            weight_decay: 0.1,
            eps: 1e-6,
            ..AdamConfig::adamw()
        }),
        [
            0.479155958,
            -1.24584103,
            1.97305191,
            -0.00972026028,
            -0.313309759,
        ],
    );
}

#[test]
fn a_parameter_without_grad_is_skipped_and_sizes_are_checked() {
    let p = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
    let mut opt = AdamW::new(AdamConfig::adamw());
    opt.step(&[ParamGrad {
        param: p.clone(),
        grad: None,
    }])
    .unwrap();
    assert_eq!(p.to_vec_f32().unwrap(), vec![1.0, 2.0]);
    let bad = Tensor::from_vec(vec![1.0f32; 3], &[3]).unwrap();
    assert!(opt
        .step(&[ParamGrad {
            param: p.clone(),
            grad: Some(bad)
        }])
        .is_err());
    assert!(
        opt.step(&[]).is_err(),
        "a changed parameter list is an error"
    );
}
