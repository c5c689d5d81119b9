//! FSDP constructor options beyond the strategy: tied parameters, ignored_modules and
//! device_id, each against its unsharded value.

use crate::common;
use common::named_values as named;

use common::{assert_close, values};
use fsdp::backend::Device;
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel};
use fsdp::nn::{
    loss, visit_parameters, Context, Embedding, InitKey, Linear, Module, Sequential, GELU,
};
use fsdp::optim::Optimizer;
use fsdp::tensor::Tensor;

/// Embedding(10, 4) whose weight is also the output projection Linear(4, 10, no bias).
fn tied_lm() -> Box<dyn Module> {
    let k = InitKey::new(21);
    let emb = Embedding::new(10, 4, 1.0, &k.child("0")).unwrap();
    let mut head = Linear::new(4, 10, false, &k.child("1")).unwrap();
    head.weight.tie_to(&emb.weight).unwrap();
    Box::new(Sequential::new(vec![Box::new(emb), Box::new(head)]))
}

const IDS: [i32; 6] = [1, 8, 3, 9, 0, 7];
const TARGETS: [i32; 6] = [2, 9, 4, 0, 1, 8];

fn lm_step(m: &mut dyn Module, lo: usize, hi: usize) -> fsdp::Result<()> {
    let ids = Tensor::from_vec(IDS[lo..hi].to_vec(), &[hi - lo])?;
    let logits = m.forward(&ids, &Context::train())?;
    let t = Tensor::from_vec(TARGETS[lo..hi].to_vec(), &[hi - lo])?;
    let (_, g) = loss::cross_entropy(&logits, &t)?;
    m.backward(&g, &Context::train())?;
    Ok(())
}

fn sgd() -> fsdp::optim::SGD {
    common::sgd(0.1)
}

#[test]
fn a_tied_embedding_and_projection_train_as_one_parameter_at_3_ranks() {
    // Unsharded: both holders add their gradient into the same tensor (plain SGD applies
    // the two updates: the summed gradient).
    let mut plain = tied_lm();
    let mut before = Vec::new();
    visit_parameters(plain.as_mut(), "", false, &mut |_, p| {
        before = p.data().unwrap().to_vec_f32().unwrap();
        Ok(())
    })
    .unwrap();
    lm_step(plain.as_mut(), 0, 6).unwrap();
    sgd()
        .step(&fsdp::optim::parameters(plain.as_mut()))
        .unwrap();
    let mut want = Vec::new();
    visit_parameters(plain.as_mut(), "", false, &mut |_, p| {
        want = p.data().unwrap().to_vec_f32().unwrap();
        Ok(())
    })
    .unwrap();
    let out = launch(&LaunchOptions::new(3), |pg: Group| {
        let mut m = FullyShardedDataParallel::new(tied_lm(), pg.clone(), FsdpConfig::default())?;
        let shard_before = m.flat_param().local_shard().to_vec_f32()?;
        lm_step(&mut m, pg.rank() * 2, pg.rank() * 2 + 2)?;
        sgd().step(&m.optimizer_params())?;
        let shard_after = m.flat_param().local_shard().to_vec_f32()?;
        let numel = m.flat_param().numel();
        Ok((numel, shard_before, shard_after, m.full_parameters()?))
    })
    .unwrap();
    for (rank, (numel, b, a, full)) in out.iter().enumerate() {
        // Flattened once: 40 elements, chunks of 14 (rows 0-3.5, 3.5-7, 7-10).
        assert_eq!(*numel, 40);
        assert_eq!(full.len(), 1, "one tensor, one entry: {full:?}");
        assert_eq!(full[0].0, "0.weight");
        assert_close(&format!("rank {rank}"), &full[0].1, &want, 1e-6, 1e-5);
        assert_ne!(b, a, "rank {rank}'s rows did not change");
    }
    // The last rank owns elements 28..40 = rows 7, 8, 9: they moved.
    assert_eq!(out[2].2.len(), 14);
    assert_close(
        "last rank's rows",
        &out[2].2[..12],
        &want[28..40],
        1e-6,
        1e-5,
    );
    assert_eq!(&out[2].1[..12], &before[28..40]);
    assert_ne!(&out[2].2[..12], &before[28..40]);
}

#[test]
fn a_tied_weight_split_over_two_units_is_refused_at_wrap_time() {
    let err = launch(&LaunchOptions::new(2), |pg: Group| {
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Linear"])),
            ..Default::default()
        };
        FullyShardedDataParallel::new(tied_lm(), pg, cfg).map(drop)
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("'0.weight'") && err.contains("'1.weight'") && err.contains("one FSDP unit"),
        "{err}"
    );
}

/// Linear(3, 4) - GELU - Linear(4, 2); the first Linear is ignored by FSDP.
fn two_layers() -> Box<dyn Module> {
    let k = InitKey::new(8);
    Box::new(Sequential::new(vec![
        Box::new(Linear::new(3, 4, true, &k.child("0")).unwrap()),
        Box::new(GELU::new()),
        Box::new(Linear::new(4, 2, true, &k.child("2")).unwrap()),
    ]))
}

fn mse_step(m: &mut dyn Module, lo: usize, hi: usize) -> fsdp::Result<()> {
    mse_rows(m, (5, 6), (3, 2), lo, hi)
}

/// Forward + backward of rows `lo..hi` of a batch drawn from `seeds` (inputs, targets)
/// with `dims` (in, out) features; MSE, mean over the rows.
fn mse_rows(
    m: &mut dyn Module,
    seeds: (u64, u64),
    dims: (usize, usize),
    lo: usize,
    hi: usize,
) -> fsdp::Result<()> {
    let (i, o) = dims;
    let x = values(seeds.0, hi * i);
    let y = values(seeds.1, hi * o);
    let out = m.forward(
        &Tensor::from_vec(x[lo * i..hi * i].to_vec(), &[hi - lo, i])?,
        &Context::train(),
    )?;
    let (_, g) = loss::mse_loss(
        &out,
        &Tensor::from_vec(y[lo * o..].to_vec(), &[hi - lo, o])?,
    )?;
    m.backward(&g, &Context::train())?;
    Ok(())
}

#[test]
fn ignored_modules_stay_whole_and_local_while_the_rest_is_sharded() {
    let out = launch(&LaunchOptions::new(2), |pg: Group| {
        let cfg = FsdpConfig {
            ignored_modules: vec!["0".into()],
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(two_layers(), pg.clone(), cfg)?;
        let flat: Vec<String> = m
            .flat_param()
            .param_infos()
            .iter()
            .map(|i| i.fqn.clone())
            .collect();
        mse_step(&mut m, pg.rank() * 4, pg.rank() * 4 + 4)?;
        sgd().step(&m.optimizer_params())?;
        Ok((flat, m.full_parameters()?))
    })
    .unwrap();
    // Per rank r: the managed Linear "2" gets the gradient averaged over ranks (= the full
    // batch's); the ignored Linear "0" steps on rank r's own gradient only.
    let full = {
        let mut m = two_layers();
        mse_step(m.as_mut(), 0, 8).unwrap();
        sgd().step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        named(m.as_mut())
    };
    for (rank, (flat, got)) in out.iter().enumerate() {
        assert_eq!(flat, &vec!["2.weight".to_string(), "2.bias".to_string()]);
        let local = {
            let mut m = two_layers();
            mse_step(m.as_mut(), rank * 4, rank * 4 + 4).unwrap();
            sgd().step(&fsdp::optim::parameters(m.as_mut())).unwrap();
            named(m.as_mut())
        };
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
        for i in 0..2 {
            assert_close(
                &format!("rank {rank} ignored {}", got[i].0),
                &got[i].1,
                &local[i].1,
                1e-6,
                1e-5,
            );
        }
        for i in 2..4 {
            assert_close(
                &format!("rank {rank} sharded {}", got[i].0),
                &got[i].1,
                &full[i].1,
                1e-6,
                1e-5,
            );
        }
    }
    assert_ne!(
        out[0].1[0].1, out[1].1[0].1,
        "ignored params are not synchronized"
    );
}

#[test]
fn an_unknown_ignored_module_is_named_in_the_error() {
    let err = launch(&LaunchOptions::new(1), |pg: Group| {
        let cfg = FsdpConfig {
            ignored_modules: vec!["encoder".into()],
            ..Default::default()
        };
        FullyShardedDataParallel::new(two_layers(), pg, cfg).map(drop)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("'encoder'"), "{err}");
}

#[test]
fn an_ignored_module_left_on_the_meta_device_is_named_at_wrap_time() {
    // FSDP neither materializes nor syncs an ignored module: built on the meta device it
    // would fail at its first forward, on that rank alone, with a device mismatch.
    let err = launch(&LaunchOptions::new(2), |pg: Group| {
        let model = if pg.rank() == 0 {
            two_layers()
        } else {
            fsdp::nn::on_meta_device(two_layers)
        };
        let cfg = FsdpConfig {
            ignored_modules: vec!["0".into()],
            sync_module_states: true,
            ..Default::default()
        };
        FullyShardedDataParallel::new(model, pg, cfg).map(drop)
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("parameter '0.weight' of an ignored module is on the meta device"),
        "{err}"
    );
}

#[test]
fn device_id_accepts_the_cpu_and_names_what_it_cannot_use() {
    let res = launch(&LaunchOptions::new(1), |pg: Group| {
        let mut out = Vec::new();
        for d in [Device::Cpu, Device::Cuda(0), Device::Meta] {
            let cfg = FsdpConfig {
                device_id: Some(d),
                ..Default::default()
            };
            out.push(
                FullyShardedDataParallel::new(two_layers(), pg.clone(), cfg)
                    .map(drop)
                    .map_err(|e| e.to_string()),
            );
        }
        Ok(out)
    })
    .unwrap();
    assert!(res[0][0].is_ok());
    if fsdp::backend::cuda::detect().is_ok() {
        // A usable GPU: device_id cuda:0 places the unit there (tests/fsdp/fsdp_cuda.rs).
        assert!(res[0][1].is_ok(), "{:?}", res[0][1]);
    } else {
        let cuda = res[0][1].as_ref().unwrap_err();
        assert!(cuda.contains("cuda:0"), "{cuda}");
    }
    let meta = res[0][2].as_ref().unwrap_err();
    assert!(meta.contains("meta"), "{meta}");
}

/// Linear(3, 5) with bias at 2 ranks, 3 micro-batches of 4 rows (2 per rank); `synced[k]`
/// says whether micro-batch k reduces (the last always does). Returns each rank's
/// (full gradient, parameters after one SGD step).
fn accumulate(offload: bool, synced: [bool; 2]) -> Vec<(Vec<f32>, Vec<f32>)> {
    use fsdp::fsdp::CpuOffload;
    launch(&LaunchOptions::new(2), |pg: Group| {
        let cfg = FsdpConfig {
            cpu_offload: CpuOffload {
                offload_params: offload,
            },
            ..Default::default()
        };
        let lin = Linear::new(3, 5, true, &InitKey::new(12))?;
        let mut m = FullyShardedDataParallel::new(Box::new(lin), pg.clone(), cfg)?;
        for (k, sync) in synced.iter().chain([&true]).enumerate() {
            let lo = k * 4 + pg.rank() * 2;
            if !sync {
                m.no_sync(|m| micro(m, lo))?;
            } else {
                micro(&mut m, lo)?;
            }
        }
        let numel = m.flat_param().numel();
        let shard = m.flat_param().grad_shard().unwrap().clone();
        let all = Tensor::zeros(&[shard.numel() * 2], fsdp::tensor::DType::F32);
        pg.all_gather_into_tensor(&all, &shard)?;
        let mut grad = all.to_vec_f32()?;
        grad.truncate(numel);
        sgd().step(&m.optimizer_params())?;
        let params = m
            .full_parameters()?
            .into_iter()
            .flat_map(|(_, v)| v)
            .collect();
        Ok((grad, params))
    })
    .unwrap()
}

/// Forward + backward of rows `lo..lo + 2` of the 12-row batch (MSE, mean over the rows).
fn micro(m: &mut dyn Module, lo: usize) -> fsdp::Result<()> {
    rows_step(m, lo, lo + 2)
}

fn rows_step(m: &mut dyn Module, lo: usize, hi: usize) -> fsdp::Result<()> {
    mse_rows(m, (31, 32), (3, 5), lo, hi)
}

#[test]
fn offload_and_no_sync_accumulate_the_sum_of_micro_batch_gradients() {
    // Unsharded: each micro-batch's 4 rows at once; gradients add up over the three.
    let mut plain: Box<dyn Module> = Box::new(Linear::new(3, 5, true, &InitKey::new(12)).unwrap());
    for k in 0..3 {
        rows_step(plain.as_mut(), k * 4, k * 4 + 4).unwrap();
    }
    let mut want_grad = Vec::new();
    visit_parameters(plain.as_mut(), "", false, &mut |_, p| {
        want_grad.extend(p.grad().unwrap().to_vec_f32().unwrap());
        Ok(())
    })
    .unwrap();
    sgd()
        .step(&fsdp::optim::parameters(plain.as_mut()))
        .unwrap();
    let want_params: Vec<f32> = named(plain.as_mut())
        .into_iter()
        .flat_map(|(_, v)| v)
        .collect();
    for offload in [false, true] {
        for synced in [[true, true], [false, true], [true, false], [false, false]] {
            let got = accumulate(offload, synced);
            for (rank, (g, p)) in got.iter().enumerate() {
                let what = format!("offload {offload} synced {synced:?} rank {rank}");
                assert_close(&format!("{what} grad"), g, &want_grad, 1e-6, 1e-5);
                assert_close(&format!("{what} params"), p, &want_params, 1e-6, 1e-5);
                if offload {
                    // Offloading moves data, never changes it.
                    let base = &accumulate(false, synced)[rank];
                    assert_eq!((g, p), (&base.0, &base.1), "{what}");
                }
            }
        }
    }
}

#[test]
fn cpu_offload_gives_bitwise_the_same_training_under_every_strategy() {
    use fsdp::fsdp::{CpuOffload, MixedPrecision, ShardingStrategy};
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ] {
        for mp in [
            None,
            Some(MixedPrecision::uniform(fsdp::tensor::DType::BF16)),
        ] {
            let run = |offload: bool| {
                launch(&LaunchOptions::new(4), |pg: Group| {
                    let cfg = FsdpConfig {
                        sharding_strategy: strategy,
                        ranks_per_node: strategy.is_hybrid().then_some(2),
                        auto_wrap_policy: Some(transformer_auto_wrap_policy(["Linear"])),
                        mixed_precision: mp,
                        cpu_offload: CpuOffload {
                            offload_params: offload,
                        },
                        ..Default::default()
                    };
                    let mut m =
                        FullyShardedDataParallel::new(common::uneven_model(5), pg.clone(), cfg)?;
                    let mem = m.memory_stats();
                    for _ in 0..2 {
                        mse_uneven(&mut m, pg.rank())?;
                        sgd().step(&m.optimizer_params())?;
                        m.zero_grad();
                    }
                    Ok((m.full_parameters()?, mem.cpu_offload))
                })
                .unwrap()
            };
            let (off, on) = (run(false), run(true));
            for r in 0..4 {
                assert!(!off[r].1 && on[r].1);
                assert_eq!(off[r].0, on[r].0, "{strategy:?} {mp:?} rank {r}");
            }
        }
    }
}

fn mse_uneven(m: &mut dyn Module, rank: usize) -> fsdp::Result<()> {
    let x = values(41, 8 * 7);
    let y = values(42, 8);
    let (lo, hi) = (rank * 2, rank * 2 + 2);
    let out = m.forward(
        &Tensor::from_vec(x[lo * 7..hi * 7].to_vec(), &[2, 7])?,
        &Context::train(),
    )?;
    let (_, g) = loss::mse_loss(&out, &Tensor::from_vec(y[lo..hi].to_vec(), &[2, 1])?)?;
    m.backward(&g, &Context::train())?;
    Ok(())
}

#[test]
fn linear_8_2_at_4_ranks_steps_adam_like_unsharded_and_clips_over_every_shard() {
    // Issue case b. Under FlatParameter sharding (FSDP1) the 18 elements split 5/5/5/3
    // (PyTorch FSDP2's per-parameter row split would leave ranks 2 and 3 empty); ranks with
    // pure padding are covered by Linear(1, 1) in fsdp_parity.rs and fsdp_grad.rs.
    use fsdp::optim::{Adam, AdamConfig};
    let x = values(51, 8 * 8);
    let y = values(52, 8 * 2);
    let step = |m: &mut dyn Module, lo: usize, hi: usize| -> fsdp::Result<()> {
        let out = m.forward(
            &Tensor::from_vec(x[lo * 8..hi * 8].to_vec(), &[hi - lo, 8])?,
            &Context::train(),
        )?;
        let (_, g) = loss::mse_loss(
            &out,
            &Tensor::from_vec(y[lo * 2..hi * 2].to_vec(), &[hi - lo, 2])?,
        )?;
        m.backward(&g, &Context::train())?;
        Ok(())
    };
    let adam = || {
        Adam::new(AdamConfig {
            lr: 1e-2,
            ..AdamConfig::adam()
        })
    };
    let mut plain: Box<dyn Module> = Box::new(Linear::new(8, 2, true, &InitKey::new(13)).unwrap());
    let mut opt = adam();
    let mut want_norm = 0.0;
    for _ in 0..3 {
        step(plain.as_mut(), 0, 8).unwrap();
        let mut sq = 0.0f32;
        visit_parameters(plain.as_mut(), "", false, &mut |_, p| {
            sq += p
                .grad()
                .unwrap()
                .to_vec_f32()
                .unwrap()
                .iter()
                .map(|g| g * g)
                .sum::<f32>();
            Ok(())
        })
        .unwrap();
        want_norm = sq.sqrt();
        opt.step(&fsdp::optim::parameters(plain.as_mut())).unwrap();
        fsdp::nn::zero_grad(plain.as_mut());
    }
    let want: Vec<f32> = named(plain.as_mut())
        .into_iter()
        .flat_map(|(_, v)| v)
        .collect();
    let out = launch(&LaunchOptions::new(4), |pg: Group| {
        let lin = Linear::new(8, 2, true, &InitKey::new(13))?;
        let mut m =
            FullyShardedDataParallel::new(Box::new(lin), pg.clone(), FsdpConfig::default())?;
        let mut opt = adam();
        let mut norm = 0.0;
        for _ in 0..3 {
            step(&mut m, pg.rank() * 2, pg.rank() * 2 + 2)?;
            norm = m.clip_grad_norm_(1e6, 2.0)?;
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        let valid = m.flat_param().valid_shard_numel();
        Ok((valid, norm, m.full_parameters()?))
    })
    .unwrap();
    let valid: Vec<usize> = out.iter().map(|o| o.0).collect();
    assert_eq!(valid, [5, 5, 5, 3]);
    for (rank, (_, norm, full)) in out.iter().enumerate() {
        assert!(
            (norm - want_norm).abs() <= 1e-5 * want_norm,
            "rank {rank}: {norm} vs {want_norm}"
        );
        let got: Vec<f32> = full.iter().flat_map(|(_, v)| v.clone()).collect();
        assert_close(&format!("rank {rank}"), &got, &want, 1e-6, 1e-5);
    }
}

#[test]
fn every_auto_wrap_policy_makes_the_units_it_names() {
    use fsdp::fsdp::{module_wrap_policy, size_based_auto_wrap_policy, AutoWrapPolicy};
    let units = |policy: Option<AutoWrapPolicy>| {
        launch(&LaunchOptions::new(2), |pg: Group| {
            let cfg = FsdpConfig {
                auto_wrap_policy: policy.clone(),
                ..Default::default()
            };
            let mut m = FullyShardedDataParallel::new(common::uneven_model(5), pg, cfg)?;
            let mut names = Vec::new();
            m.for_each_unit(&mut |u| {
                names.push(u.module_name().to_string());
                Ok(())
            })
            .unwrap();
            Ok(names)
        })
        .unwrap()
        .remove(0)
    };
    // Linear(7,5), GELU, Linear(5,7), GELU, Linear(7,1): 35 + 35 + 7 parameters.
    assert_eq!(units(None), [""]);
    assert_eq!(
        units(Some(module_wrap_policy(["Linear"]))),
        ["", "0", "2", "4"]
    );
    assert_eq!(
        units(Some(transformer_auto_wrap_policy(["GELU"]))),
        ["", "1", "3"]
    );
    assert_eq!(units(Some(size_based_auto_wrap_policy(30))), ["", "0", "2"]);
    let closure = AutoWrapPolicy::Custom(std::sync::Arc::new(|_: &dyn Module, n| n == 7));
    assert_eq!(units(Some(closure)), ["", "4"]);
}
