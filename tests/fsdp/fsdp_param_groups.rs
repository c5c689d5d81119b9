//! Parameter groups under FSDP: nanoGPT's decay / no-decay groups built on each rank from
//! `optimizer_param_names()` train like the same groups on the unsharded model, at world
//! sizes 1, 2 and 3; optimizer state dicts and checkpoints keep the groups by parameter
//! name, and a load at another world size maps them back to that rank's entries.

use crate::common;

use fsdp::checkpoint::{load_checkpoint, save_checkpoint};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel, StateDictConfig,
    StateDictType,
};
use fsdp::optim::{no_decay_groups, parameter_names, parameters, AdamConfig, AdamW, Optimizer};

const ROWS: usize = 12;

fn adamw() -> AdamW {
    // eps 1e-3: see tests/fsdp/fsdp_parity.rs (no amplified rounding noise).
    AdamW::new(AdamConfig {
        lr: 1e-2,
        eps: 1e-3,
        weight_decay: 0.5,
        ..AdamConfig::adamw()
    })
}

/// nanoGPT's groups over `names` (decay 0.5, lr 1e-2).
fn groups(names: &[(String, Vec<usize>)]) -> Vec<fsdp::optim::ParamGroup> {
    let shapes: Vec<Vec<usize>> = names.iter().map(|(_, s)| s.clone()).collect();
    no_decay_groups(&shapes, 1e-2, 0.5)
}

fn wrap(pg: Group) -> fsdp::Result<FullyShardedDataParallel> {
    let cfg = FsdpConfig {
        auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
        ..Default::default()
    };
    FullyShardedDataParallel::new(common::small_gpt(2), pg, cfg)
}

/// `steps` steps of the FSDP model with groups; each rank's rows of the global batch.
fn fsdp_steps(
    m: &mut FullyShardedDataParallel,
    opt: &mut dyn Optimizer,
    pg: &Group,
    steps: std::ops::Range<usize>,
) -> fsdp::Result<()> {
    let rows = ROWS / pg.size();
    for step in steps {
        common::gpt_step(m, step, pg.rank() * rows, (pg.rank() + 1) * rows)?;
        opt.step(&m.optimizer_params())?;
        m.zero_grad();
    }
    Ok(())
}

#[test]
fn groups_under_fsdp_train_like_the_unsharded_model() {
    // Unsharded reference with the same groups.
    let mut plain = common::small_gpt(2);
    let mut opt = adamw();
    opt.set_param_groups(groups(&parameter_names(plain.as_mut())))
        .unwrap();
    for step in 0..3 {
        common::gpt_step(plain.as_mut(), step, 0, ROWS).unwrap();
        opt.step(&parameters(plain.as_mut())).unwrap();
        fsdp::nn::zero_grad(plain.as_mut());
    }
    let mut want = Vec::new();
    fsdp::nn::visit_parameters(plain.as_mut(), "", false, &mut |n, p| {
        want.push((n.to_string(), p.data()?.to_vec_f32()?));
        Ok(())
    })
    .unwrap();
    // Without groups every parameter decays: a different model.
    let mut nogroups = common::small_gpt(2);
    let mut o2 = adamw();
    for step in 0..3 {
        common::gpt_step(nogroups.as_mut(), step, 0, ROWS).unwrap();
        o2.step(&parameters(nogroups.as_mut())).unwrap();
        fsdp::nn::zero_grad(nogroups.as_mut());
    }
    let mut bias_differs = false;
    fsdp::nn::visit_parameters(nogroups.as_mut(), "", false, &mut |n, p| {
        let w = &want.iter().find(|(m, _)| m == n).unwrap().1;
        if n.ends_with("bias") && p.data()?.to_vec_f32()? != *w {
            bias_differs = true;
        }
        Ok(())
    })
    .unwrap();
    assert!(bias_differs, "the no-decay group changes the biases");
    for w in [1usize, 2, 3] {
        let got = launch(&LaunchOptions::new(w), |pg| {
            let mut m = wrap(pg.clone())?;
            let mut opt = adamw();
            opt.set_param_groups(groups(&m.optimizer_param_names()))?;
            fsdp_steps(&mut m, &mut opt, &pg, 0..3)?;
            m.full_parameters()
        })
        .unwrap();
        for (name, vals) in &got[0] {
            let want = &want.iter().find(|(n, _)| n == name).unwrap().1;
            common::assert_close(&format!("{name} at world size {w}"), vals, want, 1e-5, 1e-4);
        }
    }
}

#[test]
fn optimizer_state_dicts_and_checkpoints_keep_groups_by_name() {
    let dir = std::env::temp_dir().join(format!("fsdp-groups-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Train 2 steps at world size 2 with groups, save a sharded checkpoint.
    let named = launch(&LaunchOptions::new(2), |pg| {
        let mut m = wrap(pg.clone())?;
        let mut opt = adamw();
        opt.set_param_groups(groups(&m.optimizer_param_names()))?;
        fsdp_steps(&mut m, &mut opt, &pg, 0..2)?;
        let osd = m.optim_state_dict(&opt, StateDictConfig::Sharded)?;
        save_checkpoint(
            &dir,
            &mut m,
            Some(&opt),
            StateDictType::Sharded,
            serde_json::json!({}),
        )?;
        Ok(osd.param_groups)
    })
    .unwrap();
    // Every rank names every parameter: the union of the ranks' memberships.
    assert_eq!(named[0], named[1]);
    let (decay, no_decay) = (&named[0][0], &named[0][1]);
    assert_eq!(decay.weight_decay, 0.5);
    assert_eq!(no_decay.weight_decay, 0.0);
    assert!(no_decay
        .params
        .iter()
        .all(|n| n.ends_with("bias") || n.contains("ln")));
    assert!(decay.params.iter().any(|n| n.ends_with("c_attn.weight")));
    let index = fsdp::checkpoint::read_index(&dir).unwrap();
    assert_eq!(index.optim.as_ref().unwrap().param_groups, named[0]);
    // Load at world sizes 1 and 3 into optimizers without groups: the groups come back,
    // as positions of that rank's entries.
    for w in [1usize, 3] {
        let loaded = launch(&LaunchOptions::new(w), |pg| {
            let mut m = wrap(pg)?;
            let mut opt = adamw();
            load_checkpoint(&dir, &mut m, Some(&mut opt as &mut dyn Optimizer))?;
            let names = m.optimizer_param_names();
            let gs = opt.param_groups().map(<[_]>::to_vec).unwrap_or_default();
            Ok((names, gs))
        })
        .unwrap();
        for (names, gs) in &loaded {
            assert_eq!(gs.len(), 2, "world size {w}");
            assert_eq!(gs[0].params.len() + gs[1].params.len(), names.len());
            for &p in &gs[1].params {
                assert!(no_decay.params.contains(&names[p].0), "{}", names[p].0);
            }
            for &p in &gs[0].params {
                assert!(decay.params.contains(&names[p].0), "{}", names[p].0);
                assert!(names[p].1.len() >= 2);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
