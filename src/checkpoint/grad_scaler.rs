//! A [`ShardedGradScaler`](crate::fsdp::ShardedGradScaler)'s state in a checkpoint: the
//! scaler's `state_dict()` under the key [`GRAD_SCALER_KEY`] of the index's `extra`,
//! written with PyTorch's key names (`{"scale": 32768.0, "growth_factor": 2.0,
//! "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 17}`), as a PyTorch
//! training script keeps `scaler.state_dict()` beside the model's and optimizer's. The
//! scale and tracker are the same on every rank (the scaler's found-inf flags are
//! all-reduced), so rank 0's index holds them once and a load at any world size restores
//! them.

use super::load::CheckpointInfo;
use crate::error::{Error, Result};
use crate::fsdp::GradScalerState;

/// The key of `extra` that holds the scaler's state.
pub const GRAD_SCALER_KEY: &str = "grad_scaler";

/// Puts `state` into `extra` under [`GRAD_SCALER_KEY`] (a `null` extra becomes an object),
/// for [`save_checkpoint`](super::save_checkpoint).
///
/// # Errors
/// `InvalidArgument` when `extra` is neither an object nor `null`.
pub fn insert_grad_scaler_state(
    extra: &mut serde_json::Value,
    state: &GradScalerState,
) -> Result<()> {
    if extra.is_null() {
        *extra = serde_json::Value::Object(serde_json::Map::new());
    }
    let Some(map) = extra.as_object_mut() else {
        crate::error::bail_arg!(
            "the checkpoint's extra value must be a JSON object to hold the grad scaler's state, got {extra}"
        );
    };
    let v = serde_json::to_value(state)
        .map_err(|e| Error::InvalidArgument(format!("grad scaler state as JSON: {e}")))?;
    map.insert(GRAD_SCALER_KEY.into(), v);
    Ok(())
}

impl CheckpointInfo {
    /// The grad scaler's state saved in this checkpoint, `None` when it has none (saved
    /// without a scaler, or by a build before scalers): what
    /// [`ShardedGradScaler::load_state_dict`](crate::fsdp::ShardedGradScaler::load_state_dict)
    /// takes.
    ///
    /// # Errors
    /// `Checkpoint` naming the directory when the value is there but is not a scaler state
    /// [`GradScalerState::validate`] accepts.
    pub fn grad_scaler_state(&self) -> Result<Option<GradScalerState>> {
        let Some(v) = self.extra.get(GRAD_SCALER_KEY) else {
            return Ok(None);
        };
        let bad = |detail: String| Error::Checkpoint {
            path: self.dir.display().to_string(),
            detail: format!("extra.{GRAD_SCALER_KEY}: {detail}"),
        };
        let state: GradScalerState =
            serde_json::from_value(v.clone()).map_err(|e| bad(e.to_string()))?;
        state.validate().map_err(|e| bad(e.to_string()))?;
        Ok(Some(state))
    }
}
