//! Zero-size parameters under FSDP: a model with an empty branch (`Linear(5, 0)`,
//! `Linear(0, 3)`; tests/common/zero_models.rs) trains like the unsharded model at world
//! sizes 1-4 under every strategy, whether the zero-size parameters sit in one
//! FlatParameter beside normal ones or each Linear is a unit (one unit's FlatParameter is
//! then entirely zero-size, another holds 3 elements, fewer than 4 ranks); state dicts
//! (full, sharded, local) and checkpoints keep the `[0, n]` / `[n, 0]` shapes; a rank with
//! an empty batch takes part and adds nothing.

use crate::common;
use crate::zero_models;
use common::STRATEGIES;

use common::assert_close;
use fsdp::backend::Device;
use fsdp::checkpoint::{
    load_checkpoint, load_state_dict_file, read_index, save_checkpoint, save_state_dict_file,
};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullStateDictConfig, FullyShardedDataParallel,
    ShardedStateDict, ShardingStrategy, StateDict, StateDictConfig, StateDictType,
};
use fsdp::nn::{loss, visit_parameters, Context, InitKey, Linear, Module, Sequential};
use fsdp::optim::{AdamConfig, AdamW, Optimizer, SgdConfig, SGD};
use std::path::PathBuf;
use zero_models::{batch, with_empty_branch, EMPTY_PARAMS};

fn optimizer(adamw: bool) -> Box<dyn Optimizer> {
    if adamw {
        Box::new(AdamW::new(AdamConfig {
            lr: 1e-2,
            eps: 1e-3,
            ..AdamConfig::adamw()
        }))
    } else {
        Box::new(SGD::new(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
            ..Default::default()
        }))
    }
}

fn config(strategy: ShardingStrategy, world: usize, per_unit: bool) -> FsdpConfig {
    FsdpConfig {
        sharding_strategy: strategy,
        auto_wrap_policy: per_unit.then(|| transformer_auto_wrap_policy(["Linear"])),
        ranks_per_node: strategy
            .is_hybrid()
            .then(|| common::hybrid_ranks_per_node(world)),
        ..Default::default()
    }
}

/// Forward + backward of mean squared error on rows `lo..hi` of step `step`'s batch.
fn step(m: &mut dyn Module, step: usize, lo: usize, hi: usize) -> fsdp::Result<()> {
    step_on(m, step, lo, hi, Device::Cpu)
}

/// [`step`] with the batch on `dev`.
fn step_on(m: &mut dyn Module, step: usize, lo: usize, hi: usize, dev: Device) -> fsdp::Result<()> {
    let (x, y) = batch(step, lo, hi);
    let out = m.forward(&x.to_device(dev)?, &Context::train())?;
    let (_, g) = loss::mse_loss(&out, &y.to_device(dev)?)?;
    m.backward(&g, &Context::train())?;
    Ok(())
}

/// Unsharded training on all 12 rows, 3 steps: `(name, values)` in parameter order.
fn reference(adamw: bool) -> Vec<(String, Vec<f32>)> {
    let mut m = with_empty_branch(13, true);
    let mut o = optimizer(adamw);
    for s in 0..3 {
        step(m.as_mut(), s, 0, 12).unwrap();
        o.step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        fsdp::nn::zero_grad(m.as_mut());
    }
    common::named_values(m.as_mut())
}

/// `(name, shape)` of every parameter of [`with_empty_branch`] (with the bias).
fn shapes() -> Vec<(String, Vec<usize>)> {
    fsdp::nn::parameter_shapes(with_empty_branch(13, true).as_mut())
}

/// Checks that every kind of state dict of `m` names every parameter with its shape.
fn check_state_dict_shapes(m: &mut FullyShardedDataParallel, what: &str) -> fsdp::Result<()> {
    let want = shapes();
    let full = m.full_state_dict(FullStateDictConfig::default())?;
    let got: Vec<(String, Vec<usize>)> = full
        .tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shape().to_vec()))
        .collect();
    assert_eq!(got, want, "{what}: full state dict shapes");
    let sharded = m.sharded_state_dict()?;
    let got: Vec<(String, Vec<usize>)> = sharded
        .tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.global_shape.clone()))
        .collect();
    assert_eq!(got, want, "{what}: sharded state dict shapes");
    for (n, _) in EMPTY_PARAMS {
        assert!(
            sharded
                .get(n)
                .unwrap()
                .pieces
                .iter()
                .all(|p| p.data.numel() == 0),
            "{what}: {n} has no elements to hold"
        );
    }
    // LOCAL: the flat shards reload into the model and leave every shape and value as it was.
    let before = m.full_state_dict(FullStateDictConfig::default())?;
    let local = m.state_dict(StateDictConfig::Local)?;
    m.load_state_dict(&local, true)?;
    let after = m.full_state_dict(FullStateDictConfig::default())?;
    for ((n, a), (_, b)) in before.tensors.iter().zip(&after.tensors) {
        assert_eq!(a.shape(), b.shape(), "{what}: {n} after a LOCAL round trip");
        assert_eq!(
            a.to_vec_f32()?,
            b.to_vec_f32()?,
            "{what}: {n} after a LOCAL round trip"
        );
    }
    let mut param_shapes = Vec::new();
    visit_parameters(m, "", false, &mut |n, p| {
        param_shapes.push((n.to_string(), p.shape().to_vec()));
        Ok(())
    })
    .unwrap();
    assert_eq!(
        param_shapes, want,
        "{what}: the wrapped model's parameter shapes"
    );
    Ok(())
}

#[test]
fn zero_size_layers_train_like_unsharded_under_every_strategy() {
    for adamw in [false, true] {
        let want = reference(adamw);
        for strategy in STRATEGIES {
            for world in 1..=4 {
                for per_unit in [false, true] {
                    let what =
                        format!("adamw {adamw} {strategy:?} world {world} per_unit {per_unit}");
                    let all = launch(&LaunchOptions::new(world), |pg: Group| {
                        let cfg = config(strategy, world, per_unit);
                        let mut m = FullyShardedDataParallel::new(
                            with_empty_branch(13, true),
                            pg.clone(),
                            cfg,
                        )?;
                        // Per Linear: one unit's FlatParameter is entirely zero-size
                        // (Linear(5, 0)), one holds 3 elements (Linear(0, 3)'s bias).
                        let mut numels = Vec::new();
                        m.for_each_unit(&mut |u| {
                            numels.push(u.flat_param().numel());
                            Ok(())
                        })
                        .unwrap();
                        let mut o = optimizer(adamw);
                        let rows = 12 / world;
                        for s in 0..3 {
                            step(&mut m, s, pg.rank() * rows, (pg.rank() + 1) * rows)?;
                            o.step(&m.optimizer_params())?;
                            m.zero_grad();
                        }
                        check_state_dict_shapes(&mut m, &what)?;
                        Ok((numels, m.full_parameters()?))
                    })
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                    for (rank, (numels, got)) in all.iter().enumerate() {
                        if per_unit {
                            assert!(
                                numels.contains(&0) && numels.contains(&3),
                                "{what}: units {numels:?}"
                            );
                        } else {
                            assert_eq!(numels, &vec![40 + 18 + 3 + 3], "{what}: one unit");
                        }
                        assert_eq!(got.len(), want.len());
                        for ((gn, gv), (wn, wv)) in got.iter().zip(&want) {
                            assert_eq!(gn, wn);
                            assert_close(&format!("{what} rank {rank} {gn}"), gv, wv, 1e-5, 1e-5);
                        }
                    }
                }
            }
        }
    }
    // The comparison is not of two untouched models: the Linear(0, 3) bias (zeros at
    // init, as PyTorch's) and the first layer moved.
    let want = reference(true);
    let bias = &want.iter().find(|(n, _)| n == "2.b.1.bias").unwrap().1;
    assert!(
        bias.iter().all(|v| v.abs() > 1e-3),
        "2.b.1.bias trained: {bias:?}"
    );
}

#[test]
fn zero_size_layers_under_fsdp_on_cuda_match_unsharded_cpu_training_cuda() {
    let dev = match fsdp::backend::cuda::detect() {
        Ok(d) if !d.is_empty() => Device::Cuda(0),
        why => {
            let why = why.map_or_else(|e| e.to_string(), |_| "no CUDA device".into());
            eprintln!("skipping zero_size_layers_under_fsdp_on_cuda on CUDA: {why}");
            return;
        }
    };
    let want = reference(false);
    let offload = fsdp::fsdp::CpuOffload {
        offload_params: true,
    };
    for (strategy, world, cpu_offload) in [
        (ShardingStrategy::FullShard, 1, Default::default()),
        (ShardingStrategy::FullShard, 4, Default::default()),
        (ShardingStrategy::ShardGradOp, 2, Default::default()),
        (ShardingStrategy::NoShard, 2, Default::default()),
        (ShardingStrategy::HybridShard, 4, Default::default()),
        (ShardingStrategy::FullShard, 2, offload),
    ] {
        for per_unit in [false, true] {
            let what = format!(
                "{strategy:?} world {world} offload {} per_unit {per_unit} on {dev}",
                cpu_offload.offload_params
            );
            let all = launch(&LaunchOptions::new(world), |pg: Group| {
                let cfg = FsdpConfig {
                    device_id: Some(dev),
                    cpu_offload,
                    ..config(strategy, world, per_unit)
                };
                let mut m =
                    FullyShardedDataParallel::new(with_empty_branch(13, true), pg.clone(), cfg)?;
                let mut o = optimizer(false);
                let rows = 12 / world;
                for s in 0..3 {
                    step_on(&mut m, s, pg.rank() * rows, (pg.rank() + 1) * rows, dev)?;
                    o.step(&m.optimizer_params())?;
                    m.zero_grad();
                }
                check_state_dict_shapes(&mut m, &what)?;
                m.full_parameters()
            })
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            for (rank, got) in all.iter().enumerate() {
                for ((gn, gv), (wn, wv)) in got.iter().zip(&want) {
                    assert_eq!(gn, wn);
                    assert_close(&format!("{what} rank {rank} {gn}"), gv, wv, 1e-5, 1e-4);
                }
            }
        }
    }
}

#[test]
fn a_rank_with_an_empty_batch_takes_part_and_adds_nothing() {
    // World 4, 3 rows: rank 3 gets none. Sum losses; FSDP averages the ranks' gradients,
    // so its SGD at lr 0.4 is unsharded SGD at lr 0.1 on the sum over all rows.
    let sum_step = |m: &mut dyn Module, lo: usize, hi: usize| -> fsdp::Result<()> {
        let (x, _) = batch(0, lo, hi);
        let out = m.forward(&x, &Context::train())?;
        let (_, g) = loss::sum_loss(&out)?;
        m.backward(&g, &Context::train())?;
        Ok(())
    };
    let sgd = |lr| {
        SGD::new(SgdConfig {
            lr,
            ..Default::default()
        })
    };
    let mut r = with_empty_branch(13, true);
    sum_step(r.as_mut(), 0, 3).unwrap();
    sgd(0.1).step(&fsdp::optim::parameters(r.as_mut())).unwrap();
    let mut want = Vec::new();
    visit_parameters(r.as_mut(), "", false, &mut |n, p| {
        want.push((n.to_string(), p.data().unwrap().to_vec_f32().unwrap()));
        Ok(())
    })
    .unwrap();
    for strategy in STRATEGIES {
        let all = launch(&LaunchOptions::new(4), |pg: Group| {
            let mut m = FullyShardedDataParallel::new(
                with_empty_branch(13, true),
                pg.clone(),
                config(strategy, 4, true),
            )?;
            let lo = pg.rank().min(3);
            sum_step(&mut m, lo, (pg.rank() + 1).min(3))?;
            sgd(0.4).step(&m.optimizer_params())?;
            m.full_parameters()
        })
        .unwrap_or_else(|e| panic!("{strategy:?}: {e}"));
        for got in &all {
            for ((gn, gv), (_, wv)) in got.iter().zip(&want) {
                assert_close(&format!("{strategy:?} {gn}"), gv, wv, 1e-6, 1e-5);
            }
        }
    }
}

/// `Linear(4, 8) - Fork(Linear(8, 8), [Linear(8, 0), Linear(0, 8)])`: parameters of shapes
/// `[0, 8]` and `[8, 0]` beside normal ones.
fn eight_model(seed: u64) -> Box<dyn Module> {
    let k = InitKey::new(seed);
    Box::new(Sequential::new(vec![
        Box::new(Linear::new(4, 8, true, &k.child("0")).unwrap()),
        Box::new(zero_models::Fork {
            a: Box::new(Linear::new(8, 8, true, &k.child("1.a")).unwrap()),
            b: Box::new(Sequential::new(vec![
                Box::new(Linear::new(8, 0, true, &k.child("1.b.0")).unwrap()),
                Box::new(Linear::new(0, 8, true, &k.child("1.b.1")).unwrap()),
            ])),
        }),
    ]))
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-zero-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// One AdamW step on 12 rows split over the world (so the optimizer has state).
fn trained(
    pg: Group,
    seed: u64,
    per_unit: bool,
) -> fsdp::Result<(FullyShardedDataParallel, AdamW)> {
    let world = pg.size();
    let mut m = FullyShardedDataParallel::new(
        eight_model(seed),
        pg.clone(),
        config(ShardingStrategy::FullShard, world, per_unit),
    )?;
    let mut o = AdamW::new(AdamConfig::adamw());
    let x = fsdp::tensor::Tensor::from_vec(common::values(7, 48), &[12, 4])?;
    let rows = x.view(pg.rank() * 12 / world * 4, &[12 / world, 4])?;
    let out = m.forward(&rows, &Context::train())?;
    let (_, g) = loss::sum_loss(&out)?;
    m.backward(&g, &Context::train())?;
    o.step(&m.optimizer_params())?;
    Ok((m, o))
}

#[test]
fn checkpoints_and_state_dict_files_keep_zero_size_shapes() {
    let want_shapes = fsdp::nn::parameter_shapes(eight_model(1).as_mut());
    assert!(want_shapes.contains(&("1.b.0.weight".into(), vec![0, 8])));
    assert!(want_shapes.contains(&("1.b.1.weight".into(), vec![8, 0])));
    for ty in [StateDictType::Sharded, StateDictType::Full] {
        for per_unit in [false, true] {
            let what = format!("{ty:?} per_unit {per_unit}");
            let dir = tmp_dir(&format!("{ty:?}-{per_unit}"));
            // Save at world 2 after one step; remember the full values.
            let saved = launch(&LaunchOptions::new(2), |pg| {
                let (mut m, o) = trained(pg, 1, per_unit)?;
                save_checkpoint(
                    &dir,
                    &mut m,
                    Some(&o as &dyn Optimizer),
                    ty,
                    serde_json::json!({}),
                )?;
                m.full_state_dict(FullStateDictConfig::default())
            })
            .unwrap()
            .remove(0);
            let index = read_index(&dir).unwrap();
            let index_shapes: Vec<(String, Vec<usize>)> = want_shapes
                .iter()
                .map(|(n, _)| (n.clone(), index.model[n].shape.clone()))
                .collect();
            assert_eq!(index_shapes, want_shapes, "{what}: index shapes");
            let adam_m = &index.optim.as_ref().unwrap().buffers["exp_avg"];
            assert_eq!(
                adam_m["1.b.1.weight"].shape,
                vec![8, 0],
                "{what}: optimizer state shape"
            );
            // Load at world 3 and 1 into a model of other initial values.
            for world in [3, 1] {
                let got = launch(&LaunchOptions::new(world), |pg| {
                    let (mut m, mut o) = trained(pg, 2, per_unit)?;
                    load_checkpoint(&dir, &mut m, Some(&mut o as &mut dyn Optimizer))?;
                    let osd = m.optim_state_dict(
                        &o,
                        StateDictConfig::Full(FullStateDictConfig::default()),
                    )?;
                    let StateDict::Full(exp_avg) = osd.buffer("exp_avg").unwrap().clone() else {
                        unreachable!()
                    };
                    Ok((m.full_state_dict(FullStateDictConfig::default())?, exp_avg))
                })
                .unwrap_or_else(|e| panic!("{what}: load at world {world}: {e}"));
                for (sd, exp_avg) in got {
                    for ((n, a), (_, b)) in sd.tensors.iter().zip(&saved.tensors) {
                        assert_eq!(a.shape(), b.shape(), "{what} world {world}: {n}");
                        assert_eq!(
                            a.to_vec_f32().unwrap(),
                            b.to_vec_f32().unwrap(),
                            "{what} world {world}: {n}"
                        );
                    }
                    assert_eq!(exp_avg.get("1.b.1.weight").unwrap().shape(), [8, 0]);
                    assert_eq!(exp_avg.get("1.b.0.weight").unwrap().shape(), [0, 8]);
                }
            }
        }
    }
    // A safetensors file of a full state dict keeps the shapes too, and loads at world 3.
    let file = tmp_dir("file").join("model.safetensors");
    let saved = launch(&LaunchOptions::new(2), |pg| {
        let (mut m, _) = trained(pg, 1, true)?;
        let sd = m.full_state_dict(FullStateDictConfig::default())?;
        if m.process_group().rank() == 0 {
            save_state_dict_file(&file, &sd)?;
        }
        Ok(sd)
    })
    .unwrap()
    .remove(0);
    let read = load_state_dict_file(&file).unwrap();
    assert_eq!(read.get("1.b.0.weight").unwrap().shape(), [0, 8]);
    assert_eq!(read.get("1.b.1.weight").unwrap().shape(), [8, 0]);
    let got = launch(&LaunchOptions::new(3), |pg| {
        let (mut m, _) = trained(pg, 2, false)?;
        m.load_state_dict(&StateDict::Full(read.clone()), true)?;
        m.full_state_dict(FullStateDictConfig::default())
    })
    .unwrap();
    for ((n, a), (_, b)) in got[0].tensors.iter().zip(&saved.tensors) {
        assert_eq!(
            (a.shape(), a.to_vec_f32().unwrap()),
            (b.shape(), b.to_vec_f32().unwrap()),
            "{n}"
        );
    }
}

#[test]
fn sharded_state_dicts_of_zero_size_parameters_merge_and_reload_at_another_world_size() {
    let dicts: Vec<ShardedStateDict> = launch(&LaunchOptions::new(4), |pg| {
        let (mut m, _) = trained(pg, 1, true)?;
        m.sharded_state_dict()
    })
    .unwrap();
    let merged = ShardedStateDict::merge(&dicts).unwrap();
    assert_eq!(merged.get("1.b.0.weight").unwrap().global_shape, vec![0, 8]);
    assert_eq!(merged.get("1.b.1.weight").unwrap().global_shape, vec![8, 0]);
    let want = launch(&LaunchOptions::new(1), |pg| {
        let (mut m, _) = trained(pg, 1, true)?;
        m.full_state_dict(FullStateDictConfig::default())
    })
    .unwrap()
    .remove(0);
    let got = launch(&LaunchOptions::new(2), |pg| {
        let (mut m, _) = trained(pg, 2, false)?;
        m.load_state_dict(&StateDict::Sharded(merged.clone()), true)?;
        m.full_state_dict(FullStateDictConfig::default())
    })
    .unwrap();
    for sd in got {
        for ((n, a), (_, b)) in sd.tensors.iter().zip(&want.tensors) {
            assert_eq!(a.shape(), b.shape(), "{n}");
            // World 4 and world 1 sum the step's gradients in another order.
            assert_close(
                n,
                &a.to_vec_f32().unwrap(),
                &b.to_vec_f32().unwrap(),
                1e-6,
                1e-5,
            );
        }
    }
}
