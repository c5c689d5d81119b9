//! What a collective is *for*, carried with it and compared across ranks before any data
//! moves, so that ranks that took different code paths fail at once with an error that
//! says where each one was, instead of pairing the wrong calls (a silent wrong result) or
//! waiting out the group timeout.
//!
//! The caller above the process group (FSDP) says what it is doing with [`enter`]: the
//! unit, the [`Phase`], the step and micro-batch, and which call of the unit this is. Every
//! collective the thread then runs carries that [`Fingerprint`] in its descriptor (the
//! `threads` backend compares descriptors in shared memory, the `tcp` backend sends them in
//! each collective's header, see `desc.rs`), and a [`CommStream`](super::CommStream) job
//! runs under the fingerprint of the thread that submitted it. Two ranks whose descriptors
//! agree on op, dtype and sizes but not on the fingerprint fail with
//! [`Error::CollectiveMismatch`](crate::Error::CollectiveMismatch) naming both calls; the
//! group's sequence number (its collectives so far) is part of the comparison on the `tcp`
//! backend and implicit in the rendezvous of the `threads` backend.
//!
//! This is what `TORCH_DISTRIBUTED_DEBUG=DETAIL` does in PyTorch (a collective fingerprint
//! checked before each call, `ProcessGroupWrapper`), without its extra collective per
//! call: the fingerprint rides on the exchange each backend already makes. The `nccl`
//! backend makes no such exchange and ignores fingerprints.
//!
//! Names are hashed ([`Name`]) so that descriptors stay `Copy` and headers fixed-size; the
//! names registered in this process are kept to print them (every rank builds the same
//! model, so a peer's unit name is known locally too).

use parking_lot::Mutex;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::OnceLock;

/// A hashed name (an FSDP unit's fully qualified module name). Compared by hash; printed by
/// the name registered with [`Name::new`] in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Name(pub u64);

fn names() -> &'static Mutex<HashMap<u64, String>> {
    static NAMES: OnceLock<Mutex<HashMap<u64, String>>> = OnceLock::new();
    NAMES.get_or_init(Default::default)
}

impl Name {
    /// The hash of `name` (64-bit FNV-1a of its UTF-8 bytes, the same in every process),
    /// registered so that it prints as `name`.
    pub fn new(name: &str) -> Name {
        let h = crate::hash::fnv1a(name.as_bytes());
        names().lock().entry(h).or_insert_with(|| name.to_string());
        Name(h)
    }
}

impl std::fmt::Display for Name {
    /// `'blocks.0'`, `root` for the empty name, or `#<hash>` for a name never registered in
    /// this process.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match names().lock().get(&self.0) {
            Some(n) if n.is_empty() => f.write_str("root"),
            Some(n) => write!(f, "'{n}'"),
            None => write!(f, "#{:016x}", self.0),
        }
    }
}

/// Which part of training a collective belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Construction: `sync_module_states`' agreement and broadcast.
    Init = 0,
    /// A unit's forward with grad enabled (its all-gather).
    Forward = 1,
    /// A unit's forward without grad (evaluation, `torch.no_grad()`).
    NoGradForward = 2,
    /// A unit's backward (the all-gather that regathers its parameters).
    Backward = 3,
    /// The reduction of a unit's gradient after its backward (reduce-scatter, all-reduce).
    Reduce = 4,
    /// `clip_grad_norm_`'s norm reduction.
    ClipGradNorm = 5,
    /// State dicts, `summon_full_params`, full parameters, optimizer state dicts.
    StateDict = 6,
    /// The ranks' agreement at the end of a backward, before waiting for its gradient
    /// reductions (which run on another communicator than the gathers).
    EndOfBackward = 7,
    /// Construction of a declared model (`fully_shard`, `fsdp_model_new`): the ranks'
    /// check that they passed the same settings and declared the same units.
    Declaration = 8,
    /// The all-gather of the updated parameter chunks after a ZeRO-1 optimizer step
    /// (`ZeroRedundancyOptimizer`).
    OptimizerStep = 9,
}

impl Phase {
    /// All phases, indexed by their code.
    pub const ALL: [Phase; 10] = [
        Phase::Init,
        Phase::Forward,
        Phase::NoGradForward,
        Phase::Backward,
        Phase::Reduce,
        Phase::ClipGradNorm,
        Phase::StateDict,
        Phase::EndOfBackward,
        Phase::Declaration,
        Phase::OptimizerStep,
    ];

    /// The phase of wire code `c`.
    pub fn from_code(c: u8) -> Option<Phase> {
        Phase::ALL.get(c as usize).copied()
    }

    fn text(self) -> &'static str {
        match self {
            Phase::Init => "init",
            Phase::Forward => "forward",
            Phase::NoGradForward => "forward without grad",
            Phase::Backward => "backward",
            Phase::Reduce => "gradient reduction",
            Phase::ClipGradNorm => crate::error::Term::ClipGradNorm.as_str(),
            Phase::StateDict => "state dict",
            Phase::EndOfBackward => "end of backward",
            Phase::Declaration => "the declaration check",
            Phase::OptimizerStep => "the parameter all-gather after a ZeRO-1 optimizer step",
        }
    }
}

/// What a collective is for: compared across ranks with the rest of the descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    /// The FSDP unit (fully qualified module name; empty for the root).
    pub unit: Name,
    /// The part of training.
    pub phase: Phase,
    /// Optimizer steps so far: FSDP counts one each time gradients that some backward
    /// produced are handed over or dropped (`optimizer_params`, `zero_grad`).
    pub step: u32,
    /// Root backward passes so far in this step (gradient-accumulation micro-batches).
    pub micro_batch: u32,
    /// Which entry of the unit into `phase` this is in the current pass, from 0 (a unit
    /// applied twice in one forward gathers twice under FullShard); for
    /// [`Phase::Reduce`], how many forward calls the reduced gradient covers; for
    /// [`Phase::EndOfBackward`], how many gradient reductions the backward issued (none
    /// under `no_sync`).
    pub call: u32,
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.phase == Phase::Declaration {
            return write!(
                f,
                "{} of {}",
                self.phase.text(),
                crate::error::Term::BuildModel
            );
        }
        write!(f, "{} of unit {}", self.phase.text(), self.unit)?;
        match self.phase {
            Phase::Init => write!(f, " ({})", crate::error::Term::SyncModuleStates),
            Phase::Declaration => Ok(()),
            Phase::StateDict | Phase::ClipGradNorm | Phase::OptimizerStep => {
                write!(f, " (step {})", self.step)
            }
            Phase::EndOfBackward => write!(
                f,
                " after {} gradient reduction{} (step {}, micro-batch {})",
                self.call,
                if self.call == 1 { "" } else { "s" },
                self.step,
                self.micro_batch
            ),
            Phase::Reduce => write!(
                f,
                " after {} forward call{} (step {}, micro-batch {})",
                self.call,
                if self.call == 1 { "" } else { "s" },
                self.step,
                self.micro_batch
            ),
            _ => write!(
                f,
                " (step {}, micro-batch {}, call {})",
                self.step, self.micro_batch, self.call
            ),
        }
    }
}

thread_local! {
    static CURRENT: Cell<Option<Fingerprint>> = const { Cell::new(None) };
}

/// The fingerprint collectives on this thread carry now.
pub fn current() -> Option<Fingerprint> {
    CURRENT.with(Cell::get)
}

/// Until the guard drops, collectives called on this thread (and jobs this thread submits
/// to a [`CommStream`](super::CommStream)) carry `fp`.
pub fn enter(fp: Option<Fingerprint>) -> Entered {
    Entered {
        before: CURRENT.with(|c| c.replace(fp)),
    }
}

/// Restores the previous fingerprint of the thread when dropped (see [`enter`]).
#[must_use = "the fingerprint applies only while the guard lives"]
pub struct Entered {
    before: Option<Fingerprint>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.before));
    }
}

/// Encoded size of an optional fingerprint on the wire.
pub(crate) const WIRE_LEN: usize = 1 + 8 + 1 + 4 + 4 + 4;

/// Little-endian bytes of `fp` (a leading 0 byte and zeros for none).
pub(crate) fn encode(fp: Option<Fingerprint>) -> [u8; WIRE_LEN] {
    let mut b = [0u8; WIRE_LEN];
    if let Some(fp) = fp {
        b[0] = 1;
        b[1..9].copy_from_slice(&fp.unit.0.to_le_bytes());
        b[9] = fp.phase as u8;
        b[10..14].copy_from_slice(&fp.step.to_le_bytes());
        b[14..18].copy_from_slice(&fp.micro_batch.to_le_bytes());
        b[18..22].copy_from_slice(&fp.call.to_le_bytes());
    }
    b
}

/// Decodes [`encode`]'s bytes; `Err` says what is wrong.
pub(crate) fn decode(b: &[u8]) -> Result<Option<Fingerprint>, String> {
    if b.len() != WIRE_LEN {
        return Err(format!(
            "a fingerprint of {} bytes (expected {WIRE_LEN})",
            b.len()
        ));
    }
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    match b[0] {
        0 => Ok(None),
        1 => {
            let mut h = [0u8; 8];
            h.copy_from_slice(&b[1..9]);
            Ok(Some(Fingerprint {
                unit: Name(u64::from_le_bytes(h)),
                phase: Phase::from_code(b[9])
                    .ok_or_else(|| format!("unknown phase code {}", b[9]))?,
                step: u32_at(10),
                micro_batch: u32_at(14),
                call: u32_at(18),
            }))
        }
        k => Err(format!("unknown fingerprint flag {k}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_round_trip_print_and_nest() {
        let fp = Fingerprint {
            unit: Name::new("blocks.3"),
            phase: Phase::Forward,
            step: 7,
            micro_batch: 2,
            call: 1,
        };
        assert_eq!(decode(&encode(Some(fp))), Ok(Some(fp)));
        assert_eq!(decode(&encode(None)), Ok(None));
        let mut bad = encode(Some(fp));
        bad[9] = 42;
        assert!(decode(&bad).unwrap_err().contains("phase code 42"));
        assert!(decode(&bad[..3]).is_err());
        assert_eq!(
            fp.to_string(),
            "forward of unit 'blocks.3' (step 7, micro-batch 2, call 1)"
        );
        let reduce = Fingerprint {
            unit: Name::new(""),
            phase: Phase::Reduce,
            call: 3,
            ..fp
        };
        assert_eq!(
            reduce.to_string(),
            "gradient reduction of unit root after 3 forward calls (step 7, micro-batch 2)"
        );
        assert_eq!(Name(12).to_string(), "#000000000000000c");
        assert_eq!(current(), None);
        {
            let _a = enter(Some(fp));
            assert_eq!(current(), Some(fp));
            {
                let _b = enter(Some(reduce));
                assert_eq!(current(), Some(reduce));
            }
            assert_eq!(current(), Some(fp));
        }
        assert_eq!(current(), None);
    }
}
