//! Learning-rate schedules and parameter groups against `torch.optim` 2.11
//! (`tests/torch_ref/lr_refs.json`, made by `tests/torch_ref/make_lr_refs.py`): the lr of
//! every epoch of LinearLR, CosineAnnealingLR, StepLR and a warm-up + cosine SequentialLR on
//! two groups; AdamW, Adam and SGD over two groups with their own lr and weight decay under
//! a warm-up; the CLI's schedule built from them; non-finite hyperparameters refused; groups
//! kept by the optimizer state dict.

use crate::common;

use fsdp::optim::{
    no_decay_groups, parameter_names, Adam, AdamConfig, AdamW, CosineAnnealingLR, LinearLR,
    LrScheduler, Optimizer, ParamGrad, ParamGroup, Scheduler, SequentialLR, SgdConfig, StepLR, SGD,
};
use fsdp::tensor::Tensor;
use serde_json::Value;

fn refs() -> Value {
    serde_json::from_str(&std::fs::read_to_string("tests/torch_ref/lr_refs.json").unwrap()).unwrap()
}

fn schedule(name: &str) -> Box<dyn LrScheduler> {
    match name {
        "linear_warmup_5" => Box::new(LinearLR {
            start_factor: 0.2,
            end_factor: 1.0,
            total_iters: 4,
        }),
        "linear_decay" => Box::new(LinearLR {
            start_factor: 1.0,
            end_factor: 0.1,
            total_iters: 7,
        }),
        "cosine_10" => Box::new(CosineAnnealingLR {
            t_max: 10,
            eta_min: 0.001,
        }),
        "cosine_1" => Box::new(CosineAnnealingLR {
            t_max: 1,
            eta_min: 0.0,
        }),
        "step_3" => Box::new(StepLR {
            step_size: 3,
            gamma: 0.5,
        }),
        "warmup_cosine" => Box::new(
            SequentialLR::new(
                vec![
                    Box::new(LinearLR {
                        start_factor: 0.25,
                        end_factor: 1.0,
                        total_iters: 3,
                    }),
                    Box::new(CosineAnnealingLR {
                        t_max: 9,
                        eta_min: 0.01,
                    }),
                ],
                vec![4],
            )
            .unwrap(),
        ),
        _ => panic!("{name}"),
    }
}

#[test]
fn schedules_give_pytorchs_learning_rates_per_group() {
    let r = refs();
    for name in [
        "linear_warmup_5",
        "linear_decay",
        "cosine_10",
        "cosine_1",
        "step_3",
        "warmup_cosine",
    ] {
        let case = &r[name];
        let s = schedule(name);
        let base: Vec<f64> = serde_json::from_value(case["base"].clone()).unwrap();
        let lrs: Vec<Vec<f64>> = serde_json::from_value(case["lrs"].clone()).unwrap();
        for (epoch, want) in lrs.iter().enumerate() {
            for (g, (&b, &w)) in base.iter().zip(want).enumerate() {
                let got = s.lr(b, epoch);
                // Closed form against PyTorch's recursive updates: f64 rounding apart.
                assert!(
                    (got - w).abs() <= 1e-15 + 1e-12 * w.abs(),
                    "{name} epoch {epoch} group {g}: {got} vs PyTorch {w}"
                );
            }
        }
    }
}

#[test]
fn sequential_lr_checks_its_milestones() {
    let lin = || -> Box<dyn LrScheduler> {
        Box::new(StepLR {
            step_size: 1,
            gamma: 0.5,
        })
    };
    assert!(SequentialLR::new(vec![lin(), lin()], vec![])
        .unwrap_err()
        .to_string()
        .contains("need 1 milestones"));
    assert!(SequentialLR::new(vec![lin(), lin(), lin()], vec![3, 3])
        .unwrap_err()
        .to_string()
        .contains("must increase"));
}

#[test]
fn schedules_check_their_arguments_as_pytorch_does() {
    let bad: Vec<(Box<dyn LrScheduler>, &str)> = vec![
        (
            Box::new(LinearLR {
                start_factor: 0.0,
                end_factor: 1.0,
                total_iters: 3,
            }),
            "LinearLR: start_factor 0 must be in (0, 1]",
        ),
        (
            Box::new(LinearLR {
                start_factor: 2.0,
                end_factor: 1.0,
                total_iters: 3,
            }),
            "start_factor 2",
        ),
        (
            Box::new(LinearLR {
                start_factor: 1.0,
                end_factor: 3.0,
                total_iters: 3,
            }),
            "LinearLR: end_factor 3 must be in [0, 1]",
        ),
        (
            Box::new(StepLR {
                step_size: 0,
                gamma: 0.5,
            }),
            "StepLR: step_size 0",
        ),
        (
            Box::new(StepLR {
                step_size: 2,
                gamma: f64::NAN,
            }),
            "StepLR: gamma NaN",
        ),
        (
            Box::new(CosineAnnealingLR {
                t_max: 4,
                eta_min: -1.0,
            }),
            "CosineAnnealingLR: eta_min -1",
        ),
    ];
    for (s, want) in bad {
        let mut opt = SGD::new(SgdConfig {
            lr: 0.1,
            ..Default::default()
        });
        let e = Scheduler::new(s, &mut opt).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
        assert_eq!(opt.lr(), 0.1, "a refused schedule changed the lr");
    }
    // Inside a SequentialLR too.
    let e = SequentialLR::new(
        vec![
            Box::new(StepLR {
                step_size: 0,
                gamma: 0.5,
            }),
            Box::new(StepLR {
                step_size: 1,
                gamma: 0.5,
            }),
        ],
        vec![2],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("StepLR: step_size 0"), "{e}");
}

/// Runs `kind` over a (2, 2) weight (decay 0.1, lr 0.01) and a (2) bias (no decay, lr
/// 0.05) with PyTorch's gradients under `LinearLR(0.5, 1, 2)`, checking every step.
fn groups_match(kind: &str, mut opt: Box<dyn Optimizer>) {
    let r = refs();
    let steps = r[format!("groups_{kind}")].as_array().unwrap().clone();
    let w = Tensor::from_vec(vec![0.5f32, -1.25, 2.0, 0.0], &[2, 2]).unwrap();
    let b = Tensor::from_vec(vec![-0.3f32, 0.7], &[2]).unwrap();
    opt.set_param_groups(vec![
        ParamGroup {
            params: vec![0],
            lr: 0.01,
            weight_decay: 0.1,
        },
        ParamGroup {
            params: vec![1],
            lr: 0.05,
            weight_decay: 0.0,
        },
    ])
    .unwrap();
    let warm = LinearLR {
        start_factor: 0.5,
        end_factor: 1.0,
        total_iters: 2,
    };
    let mut sched = Scheduler::new(Box::new(warm), opt.as_mut()).unwrap();
    assert_eq!(opt.group_lrs(), vec![0.005, 0.025]);
    let grads: [([f32; 4], [f32; 2]); 4] = [
        ([0.1, -0.2, 0.3, 0.0], [1.5, -0.5]),
        ([-0.05, 0.4, 0.1, 0.2], [-1.0, 0.25]),
        ([0.3, 0.3, -0.2, -0.1], [0.5, 0.5]),
        ([0.0, 1.0, -1.0, 0.5], [0.1, -0.1]),
    ];
    for (k, ((gw, gb), want)) in grads.iter().zip(&steps).enumerate() {
        let list = [
            ParamGrad {
                param: w.clone(),
                grad: Some(Tensor::from_vec(gw.to_vec(), &[2, 2]).unwrap()),
            },
            ParamGrad {
                param: b.clone(),
                grad: Some(Tensor::from_vec(gb.to_vec(), &[2]).unwrap()),
            },
        ];
        opt.step(&list).unwrap();
        sched.step(opt.as_mut()).unwrap();
        let ww: Vec<f32> = serde_json::from_value(want["w"].clone()).unwrap();
        let wb: Vec<f32> = serde_json::from_value(want["b"].clone()).unwrap();
        let lrs: Vec<f64> = serde_json::from_value(want["lrs"].clone()).unwrap();
        let what = format!("{kind} step {}", k + 1);
        common::assert_close(&what, &w.to_vec_f32().unwrap(), &ww, 2e-7, 2e-6);
        common::assert_close(&what, &b.to_vec_f32().unwrap(), &wb, 2e-7, 2e-6);
        let lrs: Vec<f32> = lrs.iter().map(|&l| l as f32).collect();
        assert_eq!(opt.group_lrs(), lrs, "{what}");
    }
}

#[test]
fn param_groups_match_pytorch_for_adamw_adam_and_sgd() {
    let betas = (0.9, 0.95);
    groups_match(
        "adamw",
        Box::new(AdamW::new(AdamConfig {
            lr: 0.01,
            betas,
            ..AdamConfig::adamw()
        })),
    );
    groups_match(
        "adam",
        Box::new(Adam::new(AdamConfig {
            lr: 0.01,
            ..AdamConfig::adam()
        })),
    );
    groups_match(
        "sgd",
        Box::new(SGD::new(SgdConfig {
            lr: 0.01,
            momentum: 0.9,
            ..Default::default()
        })),
    );
}

#[test]
fn groups_must_cover_the_list_once_and_survive_the_state_dict() {
    let t = |n: usize| ParamGrad {
        param: Tensor::from_vec(vec![1.0f32; n], &[n]).unwrap(),
        grad: Some(Tensor::from_vec(vec![0.5f32; n], &[n]).unwrap()),
    };
    let mut opt = AdamW::new(AdamConfig::adamw());
    let groups = vec![
        ParamGroup {
            params: vec![1],
            lr: 0.1,
            weight_decay: 0.0,
        },
        ParamGroup {
            params: vec![0, 2],
            lr: 0.2,
            weight_decay: 0.3,
        },
    ];
    opt.set_param_groups(groups.clone()).unwrap();
    // Tensor 3 is in no group.
    let e = opt.step(&[t(2), t(3), t(1), t(4)]).unwrap_err();
    assert!(
        e.to_string().contains("tensor 3 of the step list is in no"),
        "{e}"
    );
    opt.step(&[t(2), t(3), t(1)]).unwrap();
    let st = opt.state_dict().unwrap();
    assert_eq!(st.param_groups, groups);
    let mut other = AdamW::new(AdamConfig::adamw());
    other.load_state_dict(&st).unwrap();
    assert_eq!(other.param_groups(), Some(&groups[..]));
    assert_eq!(other.group_lrs(), vec![0.1, 0.2]);
    // set_lr moves every group; a group count mismatch is refused.
    other.set_lr(0.05).unwrap();
    assert_eq!(other.group_lrs(), vec![0.05, 0.05]);
    assert!(other.set_group_lrs(&[0.1]).is_err());
    // A position in two groups.
    let mut dup = groups.clone();
    dup[1].params.push(1);
    let e = other.set_param_groups(dup).unwrap_err();
    assert!(e.to_string().contains("groups 0 and 1"), "{e}");
}

#[test]
fn non_finite_hyperparameters_are_refused() {
    let mut opts: Vec<Box<dyn Optimizer>> = vec![
        Box::new(SGD::new(SgdConfig::default())),
        Box::new(Adam::new(AdamConfig::adam())),
        Box::new(AdamW::new(AdamConfig::adamw())),
    ];
    for opt in &mut opts {
        for bad in [f32::NAN, f32::INFINITY, -0.1] {
            let e = opt.set_lr(bad).unwrap_err();
            assert!(e.to_string().contains("must be finite and >= 0"), "{e}");
        }
        assert_eq!(opt.lr(), 1e-3, "unchanged after a refused set_lr");
        let e = opt
            .set_param_groups(vec![ParamGroup {
                params: vec![0],
                lr: 0.1,
                weight_decay: f32::NAN,
            }])
            .unwrap_err();
        assert!(e.to_string().contains("weight_decay NaN"), "{e}");
        // A state dict with a NaN hyperparameter.
        let mut st = opt.state_dict().unwrap();
        st.hyperparams
            .iter_mut()
            .find(|(n, _)| n == "lr")
            .unwrap()
            .1 = f64::NAN;
        assert!(opt.load_state_dict(&st).is_err());
    }
    // A config holding a bad value is refused at the step, before any update.
    let p = Tensor::from_vec(vec![1.0f32], &[1]).unwrap();
    let list = [ParamGrad {
        param: p.clone(),
        grad: Some(Tensor::from_vec(vec![1.0f32], &[1]).unwrap()),
    }];
    let mut adam = Adam::new(AdamConfig {
        betas: (0.9, 1.0),
        ..AdamConfig::adam()
    });
    assert!(adam.step(&list).unwrap_err().to_string().contains("beta2"));
    let mut sgd = SGD::new(SgdConfig {
        lr: f32::NAN,
        ..Default::default()
    });
    assert!(sgd.step(&list).is_err());
    let mut nesterov = SGD::new(SgdConfig {
        nesterov: true,
        ..Default::default()
    });
    assert!(nesterov
        .step(&list)
        .unwrap_err()
        .to_string()
        .contains("nesterov"));
    assert_eq!(p.to_vec_f32().unwrap(), vec![1.0]);
}

#[test]
fn no_decay_groups_follow_nanogpt_on_a_gpt() {
    let mut gpt = fsdp::nn::GPT::new(
        fsdp::nn::GptConfig {
            vocab_size: 11,
            block_size: 4,
            n_layer: 1,
            n_head: 2,
            n_embd: 4,
        },
        0,
    )
    .unwrap();
    let names = parameter_names(&mut gpt);
    let shapes: Vec<Vec<usize>> = names.iter().map(|(_, s)| s.clone()).collect();
    let groups = no_decay_groups(&shapes, 6e-4, 0.1);
    for &i in &groups[0].params {
        assert!(shapes[i].len() >= 2, "{} decays", names[i].0);
    }
    for &i in &groups[1].params {
        let n = &names[i].0;
        assert!(
            n.ends_with("bias") || n.contains("ln"),
            "{n} does not decay"
        );
    }
    assert_eq!(groups[0].params.len() + groups[1].params.len(), names.len());
    assert_eq!(fsdp::optim::parameters(&mut gpt).len(), names.len());
}

#[test]
fn the_cli_schedule_is_built_from_the_schedulers() {
    let cfg = fsdp::train::TrainConfig {
        lr: 1e-2,
        steps: 120,
        warmup_steps: 20,
        lr_schedule: fsdp::train::LrSchedule::Cosine,
        ..Default::default()
    };
    // The formulas the CLI used before, in f32 (a few roundings off: f32 cos of an f32
    // progress); the schedulers compute in f64 and round once. Within the 1e-6 a resumed
    // run's checkpoint check allows (train/recorded.rs).
    let old = |step: usize| -> f32 {
        let w = 20usize;
        if step <= w {
            return cfg.lr * step as f32 / w as f32;
        }
        let progress = (step - w - 1) as f32 / (cfg.steps - w - 1) as f32;
        let min = cfg.lr / 10.0;
        min + 0.5 * (cfg.lr - min) * (1.0 + (std::f32::consts::PI * progress).cos())
    };
    let sched = cfg.lr_scheduler();
    for step in 1..=cfg.steps {
        let new = cfg.lr_at(step);
        assert_eq!(new, sched.lr(cfg.lr as f64, step - 1) as f32);
        assert!(
            (new - old(step)).abs() <= 1e-6 * old(step),
            "step {step}: {new} vs {}",
            old(step)
        );
    }
    assert!((cfg.lr_at(1) - 5e-4).abs() < 1e-9);
    assert_eq!(cfg.lr_at(21), 1e-2);
    assert!((cfg.lr_at(120) - 1e-3).abs() < 1e-9);
    // No warm-up and a constant schedule: exactly --lr at every step.
    let constant = fsdp::train::TrainConfig {
        lr: 3e-3,
        warmup_steps: 0,
        ..Default::default()
    };
    assert!((1..=300).all(|s| constant.lr_at(s) == 3e-3));
}
