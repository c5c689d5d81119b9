//! What one rank of a save writes: its data files planned from its state dicts (or, for a
//! background sharded save, from the snapshots its writer thread cuts into state dicts),
//! with the manifest rank 0 builds the index from, and each piece's checksum binding it to
//! its entry (index version 4).

use super::file::{dtype_name, tensor_checksum};
use super::save::Manifest;
use super::seal::piece_head;
use crate::error::{Error, Result};
use crate::fsdp::{
    FullStateDictConfig, FullyShardedDataParallel, OptimSnapshot, OptimStateDict, ShardedSnapshot,
    StateDict, StateDictConfig, StateDictType,
};
use crate::optim::Optimizer;
use crate::tensor::Tensor;
use std::collections::HashMap;

/// This rank's data files (`(file name, tensors)`, sharing the state dicts' storage) and
/// their manifest but for the files' sizes and checksums.
pub(super) type Planned = (Manifest, Vec<(String, Vec<(String, Tensor)>)>);

/// Plans this rank's data files.
fn plan_files(
    rank: usize,
    generation: u64,
    sd: &StateDict,
    osd: Option<&OptimStateDict>,
) -> Result<Planned> {
    let mut m = Manifest::default();
    // (file name, tensors) to write.
    let mut files: Vec<(String, Vec<(String, Tensor)>)> = Vec::new();
    let mut sections: Vec<(String, &StateDict)> = vec![("model".into(), sd)];
    if let Some(o) = osd {
        sections.extend(o.buffers.iter().map(|(n, d)| (n.clone(), d)));
        m.optim = Some((o.kind.clone(), o.hyperparams.clone(), o.steps.clone()));
        m.optim_groups = o.param_groups.clone();
    }
    for (section, d) in sections {
        match d {
            StateDict::Full(f) => {
                let (fname, plain) = if section == "model" {
                    (format!("model-g{generation}.safetensors"), true)
                } else {
                    (format!("optim-g{generation}.safetensors"), false)
                };
                let fi = match files.iter().position(|(n, _)| *n == fname) {
                    Some(i) => i,
                    None => {
                        files.push((fname, Vec::new()));
                        files.len() - 1
                    }
                };
                for (name, t) in &f.tensors {
                    let key = if plain {
                        name.clone()
                    } else {
                        format!("{section}/{name}")
                    };
                    m.entries
                        .push((section.clone(), name.clone(), t.shape().to_vec()));
                    m.entry_dtypes.push(Some(dtype_name(t.dtype()).into()));
                    if t.numel() > 0 {
                        m.pieces.push((
                            section.clone(),
                            name.clone(),
                            fi,
                            key.clone(),
                            0,
                            t.numel(),
                        ));
                    }
                    files[fi].1.push((key, t.clone()));
                }
            }
            StateDict::Sharded(s) => {
                let fname = format!("rank-{rank:05}-g{generation}.safetensors");
                if files.is_empty() {
                    files.push((fname, Vec::new()));
                }
                for (name, t) in &s.tensors {
                    m.entries
                        .push((section.clone(), name.clone(), t.global_shape.clone()));
                    m.entry_dtypes.push(
                        t.pieces
                            .first()
                            .map(|p| dtype_name(p.data.dtype()).to_string()),
                    );
                    for p in &t.pieces {
                        let key = format!("{section}/{name}@{}", p.offset);
                        m.pieces.push((
                            section.clone(),
                            name.clone(),
                            0,
                            key.clone(),
                            p.offset,
                            p.data.numel(),
                        ));
                        files[0].1.push((key, p.data.clone()));
                    }
                }
            }
            StateDict::Local(_) => {
                return Err(Error::Unsupported("LOCAL_STATE_DICT checkpoints".into()))
            }
        }
    }
    Ok((m, files))
}

/// This rank's data files of a save planned from its state dicts (taken here: collectives
/// for `Full`), copied into host buffers of `pool` for a background save; a planning error
/// in the manifest.
///
/// # Errors
/// As [`save_checkpoint`], for taking the state dicts.
#[allow(clippy::too_many_arguments)]
pub(super) fn planned(
    model: &mut FullyShardedDataParallel,
    optim: Option<&dyn Optimizer>,
    ty: StateDictType,
    rank: usize,
    generation: u64,
    model_writer: bool,
    writer: bool,
    pool: Option<&mut Vec<Tensor>>,
) -> Result<Planned> {
    let config = match ty {
        StateDictType::Full => StateDictConfig::Full(FullStateDictConfig {
            offload_to_cpu: true,
            rank0_only: true,
        }),
        _ => StateDictConfig::Sharded,
    };
    let sd = model.state_dict(config)?;
    let osd = optim
        .map(|o| model.optim_state_dict(o, config))
        .transpose()?;
    let empty;
    let sd = if model_writer {
        &sd
    } else {
        empty = StateDict::Sharded(crate::fsdp::ShardedStateDict {
            world_size: model.process_group().size(),
            tensors: Vec::new(),
        });
        &empty
    };
    let planned = if writer {
        plan_files(rank, generation, sd, osd.as_ref()).and_then(|(m, mut files)| {
            if let Some(pool) = pool {
                for (_, tensors) in &mut files {
                    for (_, t) in tensors.iter_mut() {
                        *t = super::async_save::to_host(t, pool)?;
                    }
                }
            }
            Ok((m, files))
        })
    } else {
        Ok((Manifest::default(), Vec::new()))
    };
    Ok(planned.unwrap_or_else(|e| {
        let m = Manifest {
            error: Some(e.to_string()),
            ..Manifest::default()
        };
        (m, Vec::new())
    }))
}

/// The state dicts of a background sharded save's snapshots, planned into this rank's
/// files; the snapshots' host buffers are pushed onto `reuse`.
pub(super) fn plan_snapshot(
    rank: usize,
    generation: u64,
    model: Option<Box<ShardedSnapshot>>,
    optim: Option<Box<OptimSnapshot>>,
    world_size: usize,
    reuse: &mut Vec<Tensor>,
) -> Result<Planned> {
    let sd = match model {
        Some(m) => m.into_state_dict(reuse)?,
        None => crate::fsdp::ShardedStateDict {
            world_size,
            tensors: Vec::new(),
        },
    };
    let osd = optim.map(|o| o.into_state_dict(reuse)).transpose()?;
    plan_files(rank, generation, &StateDict::Sharded(sd), osd.as_ref())
}

/// Computes each piece's checksum binding its bytes to its entry's section, name, shape
/// and dtype and its offset (index version 4, `seal.rs`) into `m.piece_sums`.
pub(super) fn piece_sums(
    files: &[(String, Vec<(String, Tensor)>)],
    m: &mut Manifest,
) -> Result<()> {
    let shapes: HashMap<(&str, &str), &[usize]> = m
        .entries
        .iter()
        .map(|(s, n, shape)| ((s.as_str(), n.as_str()), shape.as_slice()))
        .collect();
    let mut sums = Vec::with_capacity(m.pieces.len());
    for (section, name, file, key, offset, numel) in &m.pieces {
        let t = files
            .get(*file)
            .and_then(|(_, ts)| ts.iter().find(|(k, _)| k == key))
            .map(|(_, t)| t)
            .ok_or_else(|| Error::Checkpoint {
                path: key.clone(),
                detail: "a planned piece has no tensor".into(),
            })?;
        let shape = shapes
            .get(&(section.as_str(), name.as_str()))
            .copied()
            .unwrap_or(&[]);
        let head = piece_head(section, name, shape, dtype_name(t.dtype()), *offset, *numel)?;
        sums.push(tensor_checksum(&head, t)?);
    }
    m.piece_sums = sums;
    Ok(())
}
