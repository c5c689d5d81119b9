//! `BatchNorm1d` and module buffers under FSDP: world sizes 1-4 (each rank normalizes its
//! own batch, no SyncBatchNorm) against a single-process reference of replicas and against
//! PyTorch (`tests/torch_ref/make_batchnorm_refs.py`), eval mode, `sync_module_states` on
//! buffers, buffers in state dicts, state-dict files moved between the wrapped and the
//! unwrapped model, checkpoints, and `buffer_dtype`.

use crate::bn_model;
use crate::common;

use bn_model::*;
use fsdp::checkpoint::{
    load_checkpoint, load_state_dict_file, save_checkpoint, save_state_dict_file,
};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    module_wrap_policy, FsdpConfig, FullStateDictConfig, FullyShardedDataParallel, MixedPrecision,
    ShardingStrategy, StateDict, StateDictConfig, StateDictType,
};
use fsdp::nn::{self, loss, Context, Module};
use fsdp::optim::Optimizer;
use fsdp::tensor::{DType, Tensor};
use fsdp::Result;

// ---------------------------------------------------------------- under FSDP

/// SGD steps of the wrapped model on rank `r`'s batches of `steps` (training mode);
/// returns the losses.
fn train_wrapped(
    m: &mut FullyShardedDataParallel,
    opt: &mut fsdp::optim::SGD,
    r: usize,
    steps: std::ops::Range<usize>,
) -> Result<Vec<f32>> {
    let mut losses = Vec::new();
    for s in steps {
        let (x, t) = batch(r, s);
        let y = m.forward(&x, &Context::train())?;
        let (l, dy) = loss::mse_loss(&y, &t)?;
        m.backward(&dy, &Context::train())?;
        opt.step(&m.optimizer_params())?;
        m.zero_grad();
        losses.push(l);
    }
    Ok(losses)
}

/// One training run: `world` ranks, `steps` SGD steps. Returns per rank the full
/// parameters (by name, f64) and the rank's own buffers.
type RankResult = (Vec<(String, Vec<f64>)>, Vec<(String, Vec<f64>)>, Vec<f32>);

fn fsdp_run(world: usize, strategy: ShardingStrategy, wrap_bn: bool) -> Vec<RankResult> {
    launch(&LaunchOptions::new(world), move |pg| {
        let r = pg.rank();
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            ranks_per_node: strategy
                .is_hybrid()
                .then(|| common::hybrid_ranks_per_node(world)),
            auto_wrap_policy: wrap_bn.then(|| module_wrap_policy(["BatchNorm1d", "Linear"])),
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(model(), pg, cfg)?;
        let mut opt = common::sgd(LR);
        let losses = train_wrapped(&mut m, &mut opt, r, 0..STEPS)?;
        let params = m
            .full_parameters()?
            .into_iter()
            .map(|(n, v)| (n, v.into_iter().map(f64::from).collect()))
            .collect();
        Ok((params, buffers(&mut m), losses))
    })
    .unwrap()
}

/// The single-process reference: one unwrapped replica per rank, each normalizing its own
/// batch with its own running stats; the replicas' gradients are averaged (what FSDP's
/// reduction computes) and every replica takes the same SGD step.
fn replica_reference(world: usize) -> (Named, Vec<Named>) {
    let mut reps: Vec<Box<dyn Module>> = (0..world).map(|_| model()).collect();
    for s in 0..STEPS {
        let mut sum: Vec<Vec<f64>> = Vec::new();
        for (r, m) in reps.iter_mut().enumerate() {
            nn::zero_grad(m.as_mut());
            let (x, t) = batch(r, s);
            let y = m.forward(&x, &Context::train()).unwrap();
            let (_, dy) = loss::mse_loss(&y, &t).unwrap();
            m.backward(&dy, &Context::train()).unwrap();
            let mut k = 0;
            nn::visit_parameters(m.as_mut(), "", false, &mut |_, p| {
                let g = p.grad().unwrap().to_vec_f64()?;
                if sum.len() <= k {
                    sum.push(vec![0.0; g.len()]);
                }
                sum[k].iter_mut().zip(&g).for_each(|(a, b)| *a += b);
                k += 1;
                Ok(())
            })
            .unwrap();
        }
        for m in reps.iter_mut() {
            let mut k = 0;
            nn::visit_parameters(m.as_mut(), "", false, &mut |_, p| {
                let mut d = p.data()?.f32_mut()?;
                for (v, g) in d.iter_mut().zip(&sum[k]) {
                    *v -= LR * (*g / world as f64) as f32;
                }
                k += 1;
                Ok(())
            })
            .unwrap();
        }
    }
    let params = common::named_values(reps[0].as_mut())
        .into_iter()
        .map(|(n, v)| (n, v.into_iter().map(f64::from).collect()))
        .collect();
    let bufs = reps.iter_mut().map(|m| buffers(m.as_mut())).collect();
    (params, bufs)
}

#[test]
fn fsdp_batchnorm_matches_per_rank_reference_world_1_to_4() {
    let refs = torch_refs();
    for world in 1..=4 {
        let (want_params, want_bufs) = replica_reference(world);
        let torch = &refs["worlds"][world.to_string()];
        let mut runs = vec![
            (
                "FullShard",
                fsdp_run(world, ShardingStrategy::FullShard, false),
            ),
            (
                "FullShard, nested units",
                fsdp_run(world, ShardingStrategy::FullShard, true),
            ),
            ("NoShard", fsdp_run(world, ShardingStrategy::NoShard, false)),
        ];
        if world == 4 {
            runs.push((
                "HybridShard",
                fsdp_run(world, ShardingStrategy::HybridShard, true),
            ));
        }
        for (what, ranks) in runs {
            // Worst errors against the replicas and against PyTorch (printed with
            // --nocapture).
            let (mut vs_rep, mut vs_torch) = (0.0f64, 0.0f64);
            for (r, (params, bufs, losses)) in ranks.iter().enumerate() {
                let at = format!("world {world}, {what}, rank {r}");
                for ((n, got), (wn, want)) in params.iter().zip(&want_params) {
                    assert_eq!(n, wn);
                    vs_rep = vs_rep.max(check(&format!("{at}: {n}"), got, want, 1e-6));
                    vs_torch = vs_torch.max(check(
                        &format!("{at}: {n} vs PyTorch"),
                        got,
                        &json_vec(&torch["params"][n]),
                        1e-6,
                    ));
                }
                assert_eq!(bufs.len(), 3, "{at}: buffers {bufs:?}");
                for ((n, got), (wn, want)) in bufs.iter().zip(&want_bufs[r]) {
                    assert_eq!(n, wn);
                    vs_rep = vs_rep.max(check(&format!("{at}: {n}"), got, want, 1e-6));
                    let t = json_vec(&torch["buffers"][r][n]);
                    vs_torch = vs_torch.max(check(&format!("{at}: {n} vs PyTorch"), got, &t, 1e-6));
                }
                let tl: Vec<f64> = torch["losses"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s[r].as_f64().unwrap())
                    .collect();
                check(
                    &format!("{at}: losses vs PyTorch"),
                    &losses.iter().map(|&l| l as f64).collect::<Vec<_>>(),
                    &tl,
                    1e-6,
                );
            }
            eprintln!(
                "world {world}, {what}: parameters and running stats within {vs_rep:.1e} of the replicas (tolerance 1e-6), {vs_torch:.1e} of PyTorch f64 (1e-6)"
            );
            if world > 1 {
                // Each rank's running stats are its own (different batches).
                assert_ne!(ranks[0].1[0].1, ranks[1].1[0].1, "world {world}, {what}");
            }
        }
    }
}

#[test]
fn eval_mode_under_fsdp_uses_running_stats() -> Result<()> {
    let refs = torch_refs();
    let want = json_vec(&refs["worlds"]["2"]["eval_out"]);
    let out = launch(&LaunchOptions::new(2), |pg| {
        let r = pg.rank();
        let mut m = FullyShardedDataParallel::new(model(), pg, FsdpConfig::default())?;
        let mut opt = common::sgd(LR);
        train_wrapped(&mut m, &mut opt, r, 0..STEPS)?;
        let before = buffers(&mut m);
        let y = m.forward(&batch(0, 0).0, &Context::eval())?.to_vec_f64()?;
        assert_eq!(before, buffers(&mut m), "eval changed the running stats");
        Ok(y)
    })?;
    check("rank 0 eval output vs PyTorch", &out[0], &want, 1e-6);
    Ok(())
}

#[test]
fn sync_module_states_broadcasts_buffers() {
    for (world, strategy) in [
        (3, ShardingStrategy::FullShard),
        (4, ShardingStrategy::HybridShard),
        (2, ShardingStrategy::NoShard),
    ] {
        for sync in [true, false] {
            let got = launch(&LaunchOptions::new(world), move |pg| {
                let r = pg.rank();
                let mut base = model();
                perturb_buffers(base.as_mut(), r);
                let cfg = FsdpConfig {
                    sharding_strategy: strategy,
                    ranks_per_node: strategy.is_hybrid().then_some(2),
                    sync_module_states: sync,
                    auto_wrap_policy: Some(module_wrap_policy(["BatchNorm1d"])),
                    ..FsdpConfig::default()
                };
                let mut m = FullyShardedDataParallel::new(base, pg, cfg)?;
                Ok(bits(&buffers(&mut m)))
            })
            .unwrap();
            for (r, b) in got.iter().enumerate() {
                assert_eq!(b.len(), 3);
                if sync {
                    assert_eq!(
                        b, &got[0],
                        "world {world} {strategy:?}: rank {r} differs from rank 0"
                    );
                } else if r > 0 {
                    assert_ne!(
                        b, &got[0],
                        "world {world}: without sync_module_states ranks keep their own"
                    );
                }
            }
        }
    }
}

#[test]
fn state_dicts_carry_buffers_and_load_them() -> Result<()> {
    launch(&LaunchOptions::new(2), |pg| {
        let r = pg.rank();
        let mut base = model();
        perturb_buffers(base.as_mut(), r);
        let mut m = FullyShardedDataParallel::new(base, pg, FsdpConfig::default())?;
        let mine = buffers(&mut m);
        let full = m.state_dict(StateDictConfig::Full(FullStateDictConfig::default()))?;
        let sharded = m.state_dict(StateDictConfig::Sharded)?;
        let local = m.state_dict(StateDictConfig::Local)?;
        let StateDict::Full(f) = &full else {
            unreachable!()
        };
        assert_eq!(full.keys(), STATE_DICT_KEYS);
        assert_eq!(f.get("1.num_batches_tracked").unwrap().dtype(), DType::I64);
        assert_eq!(f.get("1.running_var").unwrap().to_vec_f64()?, mine[1].1);
        let StateDict::Sharded(s) = &sharded else {
            unreachable!()
        };
        assert_eq!(
            s.get("1.running_mean").unwrap().pieces[0]
                .data
                .to_vec_f64()?,
            mine[0].1
        );
        let StateDict::Local(l) = &local else {
            unreachable!()
        };
        assert_eq!(l.buffers.len(), 3);
        // Each kind loads back: zero the buffers, load, compare.
        for sd in [&full, &sharded, &local] {
            nn::visit_buffers(&mut m, "", false, &mut |_, b| b.data.zero_())?;
            m.load_state_dict(sd, true)?;
            assert_eq!(buffers(&mut m), mine, "{:?}", sd.state_dict_type());
        }
        // A wrong shape or a missing buffer is a clear error; nothing is written.
        let StateDict::Full(mut bad) = full.clone() else {
            unreachable!()
        };
        bad.tensors.retain(|(n, _)| n != "1.running_mean");
        let e = m
            .load_state_dict(&StateDict::Full(bad.clone()), true)
            .unwrap_err();
        assert!(e.to_string().contains("1.running_mean"), "{e}");
        let keys = m.load_state_dict(&StateDict::Full(bad.clone()), false)?;
        assert_eq!(keys.missing_keys, ["1.running_mean"]);
        bad.tensors.push((
            "1.running_mean".into(),
            Tensor::from_vec(vec![0.0f32; 5], &[5])?,
        ));
        let e = m.load_state_dict(&StateDict::Full(bad), true).unwrap_err();
        assert!(e.to_string().contains("expected shape [6]"), "{e}");
        Ok(())
    })?;
    Ok(())
}

/// What one rank of [`state_dict_files_move_between_wrapped_and_unwrapped`] saw: the
/// wrapped model's eval output, the unwrapped model's after loading the wrapped file, the
/// unwrapped model's eval output and buffers after one more step, and the wrapped model's
/// after loading that file (eval outputs as bits, buffers as f64 bits).
type FileTrip = (
    Vec<u32>,
    Vec<u32>,
    Vec<u32>,
    Vec<u32>,
    Vec<(String, Vec<u64>)>,
    Vec<(String, Vec<u64>)>,
);

/// At world sizes 1 and 2 (nested units, each rank with running stats of its own): rank 0
/// saves FSDP's full state dict to a file, which loads strictly into the unwrapped model
/// (its eval output: the wrapped rank 0's, bit for bit, and PyTorch's); the unwrapped
/// model trains one more step and saves `nn::state_dict` to a file (the same keys and
/// dtypes as FSDP's), which loads strictly into the wrapped model on every rank (eval
/// output and buffers: the unwrapped model's, bit for bit).
#[test]
fn state_dict_files_move_between_wrapped_and_unwrapped() -> Result<()> {
    let refs = torch_refs();
    for world in [1, 2] {
        let dir =
            std::env::temp_dir().join(format!("fsdp-bn-files-{}-{world}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (wrapped_file, unwrapped_file) = (
            dir.join("wrapped.safetensors"),
            dir.join("unwrapped.safetensors"),
        );
        let out = launch(&LaunchOptions::new(world), |pg| -> Result<FileTrip> {
            let r = pg.rank();
            let cfg = FsdpConfig {
                auto_wrap_policy: Some(module_wrap_policy(["BatchNorm1d", "Linear"])),
                ..FsdpConfig::default()
            };
            let mut m = FullyShardedDataParallel::new(model(), pg.clone(), cfg)?;
            let mut opt = common::sgd(LR);
            train_wrapped(&mut m, &mut opt, r, 0..STEPS)?;
            let wrapped_eval = f32_bits(&eval_out(&mut m));
            let config = FullStateDictConfig {
                rank0_only: true,
                offload_to_cpu: true,
            };
            let full = m.full_state_dict(config)?;
            if r == 0 {
                save_state_dict_file(&wrapped_file, &full)?;
            }
            pg.barrier()?;
            // Wrapped file -> unwrapped model, strictly.
            let mut u = model();
            let sd = load_state_dict_file(&wrapped_file)?;
            assert_eq!(
                nn::load_state_dict(u.as_mut(), &sd, true)?,
                Default::default()
            );
            let unwrapped_eval = f32_bits(&eval_out(u.as_mut()));
            // Unwrapped model, one more step -> file -> wrapped model, strictly.
            train_unwrapped(u.as_mut(), 0, STEPS..STEPS + 1);
            let usd = nn::state_dict(u.as_mut())?;
            if r == 0 {
                assert_eq!(keys_and_dtypes(&usd), keys_and_dtypes(&full));
                save_state_dict_file(&unwrapped_file, &usd)?;
            }
            pg.barrier()?;
            let sd = load_state_dict_file(&unwrapped_file)?;
            assert_eq!(
                m.load_state_dict(&StateDict::Full(sd), true)?,
                Default::default()
            );
            Ok((
                wrapped_eval,
                unwrapped_eval,
                f32_bits(&eval_out(u.as_mut())),
                f32_bits(&eval_out(&mut m)),
                bits(&buffers(u.as_mut())),
                bits(&buffers(&mut m)),
            ))
        })?;
        let _ = std::fs::remove_dir_all(&dir);
        let torch = json_vec(&refs["worlds"][world.to_string()]["eval_out"]);
        for (r, (_, unwrapped_eval, u_after, m_after, u_bufs, m_bufs)) in out.iter().enumerate() {
            let at = format!("world {world}, rank {r}");
            // Every rank's unwrapped model holds rank 0's saved state.
            assert_eq!(
                unwrapped_eval, &out[0].0,
                "{at}: unwrapped vs wrapped rank 0"
            );
            let got: Vec<f64> = unwrapped_eval
                .iter()
                .map(|&b| f32::from_bits(b) as f64)
                .collect();
            check(
                &format!("{at}: unwrapped eval vs PyTorch"),
                &got,
                &torch,
                1e-6,
            );
            assert_ne!(
                u_after, unwrapped_eval,
                "{at}: the extra step changed nothing"
            );
            assert_eq!(m_after, u_after, "{at}: wrapped after the unwrapped file");
            assert_eq!(m_bufs, u_bufs, "{at}: buffers");
            assert_eq!(
                u_bufs[2].1,
                [(STEPS as f64 + 1.0).to_bits()],
                "{at}: num_batches_tracked"
            );
        }
        if world == 2 {
            assert_ne!(out[1].0, out[0].0, "rank 1's own running stats");
        }
    }
    Ok(())
}

#[test]
fn buffers_survive_checkpoint_resume_at_another_world_size() -> Result<()> {
    for ty in [StateDictType::Sharded, StateDictType::Full] {
        let dir = std::env::temp_dir().join(format!("fsdp-bn-{}-{ty:?}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.clone();
        let saved = launch(&LaunchOptions::new(2), move |pg| {
            let r = pg.rank();
            let mut m = FullyShardedDataParallel::new(model(), pg, FsdpConfig::default())?;
            let mut opt = common::sgd(LR);
            train_wrapped(&mut m, &mut opt, r, 0..2)?;
            save_checkpoint(&d, &mut m, Some(&opt), ty, serde_json::Value::Null)?;
            Ok((buffers(&mut m), m.full_parameters()?))
        })?;
        let d = dir.clone();
        let loaded = launch(&LaunchOptions::new(3), move |pg| {
            let mut m = FullyShardedDataParallel::new(model(), pg, FsdpConfig::default())?;
            let mut opt = common::sgd(LR);
            load_checkpoint(&d, &mut m, Some(&mut opt))?;
            Ok((buffers(&mut m), m.full_parameters()?))
        })?;
        for (r, (b, p)) in loaded.iter().enumerate() {
            // Every rank resumes with rank 0's saved buffers (as a PyTorch load does).
            assert_eq!(b, &saved[0].0, "{ty:?}: rank {r} buffers");
            assert_eq!(p, &saved[0].1, "{ty:?}: rank {r} parameters");
        }
        assert_eq!(
            saved[0].0[2].1,
            vec![2.0],
            "num_batches_tracked after 2 steps"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

#[test]
fn buffer_dtype_rounds_buffers_at_forward() -> Result<()> {
    let out = launch(&LaunchOptions::new(2), |pg| {
        let mut base = model();
        // Values that bf16 cannot hold.
        nn::visit_buffers(base.as_mut(), "", false, &mut |n, b| {
            if n.ends_with("running_mean") {
                b.data
                    .copy_from(&Tensor::from_vec(vec![0.1f32 + 1e-4; HID], &[HID])?)?;
            }
            Ok(())
        })?;
        let cfg = FsdpConfig {
            mixed_precision: Some(MixedPrecision {
                buffer_dtype: Some(DType::BF16),
                ..MixedPrecision::default()
            }),
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(base, pg, cfg)?;
        let before = buffers(&mut m)[0].1.clone();
        m.forward(&batch(0, 0).0, &Context::eval())?;
        let after = buffers(&mut m)[0].1.clone();
        let sd = m.state_dict(StateDictConfig::Full(FullStateDictConfig::default()))?;
        let StateDict::Full(f) = sd else {
            unreachable!()
        };
        Ok((before, after, f.get("1.running_mean").unwrap().dtype()))
    })?;
    let (before, after, dtype) = &out[0];
    assert!(before.iter().all(|&v| v as f32 == 0.1f32 + 1e-4));
    let want = half::bf16::from_f32(0.1f32 + 1e-4).to_f32() as f64;
    assert!(after.iter().all(|&v| v == want), "{after:?} vs {want}");
    assert_eq!(
        *dtype,
        DType::F32,
        "state dicts return buffers in full precision"
    );
    Ok(())
}
