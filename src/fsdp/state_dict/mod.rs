//! State dicts of an FSDP model and of its optimizer, and `summon_full_params`
//! (`torch.distributed.fsdp.FullyShardedDataParallel.state_dict_type`, `state_dict`,
//! `load_state_dict`, `optim_state_dict`, `optim_state_dict_to_load`,
//! `summon_full_params`).
//!
//! | type | what each rank holds | load at another world size | PyTorch |
//! |---|---|---|---|
//! | [`FullStateDict`] | every original parameter, whole, under its original name (empty off rank 0 with `rank0_only`) | yes | `FULL_STATE_DICT` |
//! | [`ShardedStateDict`] | each original parameter's global shape and this rank's piece of it (element offset into the row-major flattened parameter) | yes, from the pieces of every rank ([`ShardedStateDict::merge`] or a sharded checkpoint) | `SHARDED_STATE_DICT` |
//! | [`LocalStateDict`] | each unit's flat shard, as the FlatParameter holds it | no: an error quoting both world sizes | `LOCAL_STATE_DICT` |
//!
//! Names are those of `model.state_dict()` on the unwrapped model (FSDP adds no prefix): a
//! tied parameter appears under each of its names, as `nn.Module.state_dict` shows it.
//! Values are the f32 master values, whatever the mixed-precision policy (as FSDP1, which
//! takes state dicts in full precision). Persistent module buffers (BatchNorm's running
//! stats) are in every type, whole and in their own dtype (`buffers.rs`): each rank's own
//! values, which a load replaces on every rank.
//!
//! Sharded pieces follow the FlatParameter: a parameter's piece on rank `r` is the part of
//! its flattened elements that falls into rank `r`'s chunk, so taking a sharded state dict
//! needs no communication. (FSDP1 chunks each parameter along dim 0 instead; the two carry
//! the same information.)
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | the types |
//! | `layout.rs` | where each parameter's elements sit in a unit's chunk; reading sources |
//! | `buffers.rs` | module buffers: taking them, and finding each type's entry for a load (the checks, the writes and the key order are `nn::state_dict`'s, shared with unwrapped modules) |
//! | `model.rs` | `state_dict`, `load_state_dict` |
//! | `optim.rs` | [`OptimStateDict`], `optim_state_dict`, `optim_state_dict_to_load` |
//! | `optim_cut.rs` | cutting optimizer state at parameter boundaries; the snapshot of a background save |
//! | `summon.rs` | `summon_full_params` |

mod buffers;
mod layout;
mod model;
mod optim;
mod optim_cut;
mod optim_groups;
mod summon;

/// Whole parameters by original name (FULL_STATE_DICT); the type of every module's
/// [`crate::nn::state_dict`].
pub use crate::nn::FullStateDict;
/// Keys a non-strict load skipped (`_IncompatibleKeys`), as [`crate::nn::load_state_dict`]
/// reports them.
pub use crate::nn::IncompatibleKeys;
pub(crate) use model::ShardedSnapshot;
pub(crate) use optim::OptimSnapshot;
pub use optim::OptimStateDict;
pub use optim_groups::NamedParamGroup;

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Which kind of state dict (`torch.distributed.fsdp.StateDictType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StateDictType {
    /// `FULL_STATE_DICT`: unflattened, whole parameters under their original names.
    Full,
    /// `SHARDED_STATE_DICT`: each rank's pieces of each original parameter, with the global
    /// shape and element offsets needed to reload at any world size.
    Sharded,
    /// `LOCAL_STATE_DICT`: each unit's flat shard as it is; reloadable only at the same
    /// world size and rank.
    Local,
}

/// Options of a full state dict (`torch.distributed.fsdp.FullStateDictConfig`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FullStateDictConfig {
    /// Copy the gathered tensors to host memory (`offload_to_cpu=True`); otherwise they
    /// stay on the device of the shards. On the CPU backend every tensor already is in host
    /// memory, so this changes nothing there. (SHARDED and LOCAL state dicts are always
    /// in host memory.)
    pub offload_to_cpu: bool,
    /// Only rank 0 keeps the result; other ranks take part in the gathers and get an empty
    /// dict (`rank0_only=True`).
    pub rank0_only: bool,
}

/// What [`FullyShardedDataParallel::state_dict`](super::FullyShardedDataParallel::state_dict)
/// produces (`FSDP.state_dict_type(model, type, config)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDictConfig {
    /// A [`FullStateDict`] with these options.
    Full(FullStateDictConfig),
    /// A [`ShardedStateDict`].
    Sharded,
    /// A [`LocalStateDict`].
    Local,
}

impl StateDictConfig {
    /// The [`StateDictType`] this config produces.
    pub fn state_dict_type(&self) -> StateDictType {
        match self {
            StateDictConfig::Full(_) => StateDictType::Full,
            StateDictConfig::Sharded => StateDictType::Sharded,
            StateDictConfig::Local => StateDictType::Local,
        }
    }
}

/// One rank's piece of a parameter: elements `offset .. offset + data.numel()` of the
/// row-major flattened parameter.
#[derive(Debug, Clone)]
pub struct ShardPiece {
    /// Element offset into the flattened parameter.
    pub offset: usize,
    /// The values, 1-D f32 (own storage).
    pub data: Tensor,
    /// Data-parallel rank that held the piece.
    pub rank: usize,
}

/// One original parameter in a sharded state dict (`ShardedTensor` / `DTensor`): its global
/// shape and the pieces at hand.
#[derive(Debug, Clone)]
pub struct ShardedTensor {
    /// Shape of the whole parameter.
    pub global_shape: Vec<usize>,
    /// The pieces this dict holds, in no particular order; they never overlap partially
    /// (pieces from one sharding are disjoint; [`ShardedStateDict::merge`] drops exact
    /// duplicates from replicas).
    pub pieces: Vec<ShardPiece>,
}

impl ShardedTensor {
    /// Element count of the whole parameter.
    pub fn global_numel(&self) -> usize {
        crate::tensor::numel_of(&self.global_shape)
    }
}

/// Every parameter's global shape and this rank's pieces (SHARDED_STATE_DICT). A key is
/// present for every parameter even when this rank holds no piece of it.
#[derive(Debug, Clone, Default)]
pub struct ShardedStateDict {
    /// Data-parallel world size the pieces were taken at.
    pub world_size: usize,
    /// `(name, tensor)` pairs in `model.state_dict()` order.
    pub tensors: Vec<(String, ShardedTensor)>,
}

impl ShardedStateDict {
    /// The entry called `name`.
    pub fn get(&self, name: &str) -> Option<&ShardedTensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// The union of several ranks' sharded state dicts (what a sharded checkpoint's index
    /// describes): every key of any of them, with all their pieces; pieces that repeat
    /// (replicas under NoShard or hybrid sharding) are kept once.
    ///
    /// # Errors
    /// `StateDict` when the dicts come from different world sizes or disagree on a
    /// parameter's global shape, or when two pieces overlap without being equal in range.
    pub fn merge(dicts: &[ShardedStateDict]) -> Result<ShardedStateDict> {
        let mut out = ShardedStateDict {
            world_size: dicts.first().map_or(0, |d| d.world_size),
            tensors: Vec::new(),
        };
        for d in dicts {
            if d.world_size != out.world_size {
                return Err(Error::StateDict(format!(
                    "cannot merge sharded state dicts of world sizes {} and {}",
                    out.world_size, d.world_size
                )));
            }
            for (name, t) in &d.tensors {
                let idx = match out.tensors.iter().position(|(n, _)| n == name) {
                    Some(i) => i,
                    None => {
                        out.tensors.push((
                            name.clone(),
                            ShardedTensor {
                                global_shape: t.global_shape.clone(),
                                pieces: Vec::new(),
                            },
                        ));
                        out.tensors.len() - 1
                    }
                };
                let dst = &mut out.tensors[idx].1;
                if dst.global_shape != t.global_shape {
                    return Err(Error::StateDict(format!(
                        "'{name}': pieces disagree on the global shape ({:?} and {:?})",
                        dst.global_shape, t.global_shape
                    )));
                }
                for p in &t.pieces {
                    let (a, b) = (p.offset, p.offset + p.data.numel());
                    let mut dup = false;
                    for q in &dst.pieces {
                        let (c, d) = (q.offset, q.offset + q.data.numel());
                        if (a, b) == (c, d) {
                            dup = true;
                        } else if a < d && c < b {
                            return Err(Error::StateDict(format!(
                                "'{name}': piece [{a}, {b}) of rank {} overlaps piece [{c}, {d}) of rank {}",
                                p.rank, q.rank
                            )));
                        }
                    }
                    if !dup {
                        dst.pieces.push(p.clone());
                    }
                }
            }
        }
        Ok(out)
    }
}

/// One unit's flat shard as the FlatParameter holds it.
#[derive(Debug, Clone)]
pub struct LocalFlatShard {
    /// Unpadded element count `N` of the whole FlatParameter.
    pub numel: usize,
    /// This rank's chunk, `(ceil(N / W))` f32, zero padding included (own storage).
    pub shard: Tensor,
}

/// This rank's flat shards (LOCAL_STATE_DICT): one entry per unit, keyed
/// `<unit module name>.flat_param` (`flat_param` for the root), plus the parameters of
/// ignored modules, whole.
#[derive(Debug, Clone, Default)]
pub struct LocalStateDict {
    /// Data-parallel world size it was taken at.
    pub world_size: usize,
    /// Data-parallel rank it was taken on.
    pub rank: usize,
    /// Ranks each FlatParameter was split over (the world, one node under hybrid
    /// sharding, 1 under NoShard).
    pub shard_world_size: usize,
    /// This rank's chunk index among them.
    pub shard_rank: usize,
    /// `(key, shard)` per unit, root first then nested units in pre-order.
    pub flat_params: Vec<(String, LocalFlatShard)>,
    /// Parameters of ignored modules, whole, by name.
    pub params: Vec<(String, Tensor)>,
    /// Persistent module buffers, whole, by name, in their own dtype (buffers are never
    /// flattened).
    pub buffers: Vec<(String, Tensor)>,
}

/// A state dict of any of the three types.
#[derive(Debug, Clone)]
pub enum StateDict {
    /// FULL_STATE_DICT.
    Full(FullStateDict),
    /// SHARDED_STATE_DICT.
    Sharded(ShardedStateDict),
    /// LOCAL_STATE_DICT.
    Local(LocalStateDict),
}

impl StateDict {
    /// Which type this is.
    pub fn state_dict_type(&self) -> StateDictType {
        match self {
            StateDict::Full(_) => StateDictType::Full,
            StateDict::Sharded(_) => StateDictType::Sharded,
            StateDict::Local(_) => StateDictType::Local,
        }
    }

    /// Every key, in order.
    pub fn keys(&self) -> Vec<&str> {
        match self {
            StateDict::Full(d) => d.tensors.iter().map(|(n, _)| n.as_str()).collect(),
            StateDict::Sharded(d) => d.tensors.iter().map(|(n, _)| n.as_str()).collect(),
            StateDict::Local(d) => d
                .flat_params
                .iter()
                .map(|(n, _)| n.as_str())
                .chain(d.params.iter().map(|(n, _)| n.as_str()))
                .chain(d.buffers.iter().map(|(n, _)| n.as_str()))
                .collect(),
        }
    }
}

/// A state-dict entry's global shape and the part of it this rank holds (see
/// [`FullyShardedDataParallel::state_dict_ranges`](crate::fsdp::FullyShardedDataParallel::state_dict_ranges)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRange {
    /// The state-dict name (`model.state_dict()` key).
    pub name: String,
    /// Shape of the whole parameter.
    pub shape: Vec<usize>,
    /// Elements `[lo, hi)` of the flattened parameter in this rank's chunk; `None` when
    /// the chunk holds none of it.
    pub range: Option<(usize, usize)>,
}
