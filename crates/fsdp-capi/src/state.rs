//! The model's full state dict handed to a host callback, and checkpoints saved to and
//! loaded from a directory (`fsdp::checkpoint`: crash-safe, loadable at any world size
//! and strategy).

use super::device::on_stream;
use super::dlpack::describe;
use super::handles::{fsdp_model_t, fsdp_optimizer_t};
use super::hooks::device;
use super::model::with_model;
use super::optim::with_optimizer;
use super::{c_str, fsdp_status, guard, Fail, Res, FSDP_ERR_CALLBACK};
use fsdp::checkpoint::{load_checkpoint, save_checkpoint};
use fsdp::fsdp::{FullStateDictConfig, StateDictType};
use std::ffi::{c_char, c_void, CString};
use std::path::Path;

/// `StateDictType.SHARDED_STATE_DICT`: every rank writes its own pieces.
pub const FSDP_CHECKPOINT_SHARDED: i32 = 0;
/// `StateDictType.FULL_STATE_DICT`: rank 0 writes whole tensors.
pub const FSDP_CHECKPOINT_FULL: i32 = 1;

/// Called once per parameter by [`fsdp_model_full_state_dict`] with the host's `ctx`, the
/// parameter's fully qualified name and its whole value (float32, its shape, host
/// memory); both valid only during the call (copy what you keep). Return 0 to go on,
/// anything else to stop (the call then returns `FSDP_ERR_CALLBACK`). Must not unwind
/// (no C++ exception, no `longjmp`) through fsdp.
#[allow(non_camel_case_types)]
pub type fsdp_tensor_callback = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        name: *const c_char,
        tensor: *const super::DLTensor,
    ) -> i32,
>;

/// The full state dict (`FULL_STATE_DICT`): gathers every unit's parameters (a
/// collective: every rank calls it) and calls `callback` once per parameter in
/// `state_dict()` order. With `rank0_only`, only rank 0's callback is called.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` (`callback` NULL,
/// `stream`); `FSDP_ERR_CALLBACK` when the callback returned non-zero; collective errors.
///
/// # Safety
/// `callback` is a function that may be called with `ctx`.
#[no_mangle]
pub unsafe extern "C" fn fsdp_model_full_state_dict(
    model: fsdp_model_t,
    rank0_only: bool,
    callback: fsdp_tensor_callback,
    ctx: *mut c_void,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_model_full_state_dict", || {
        let Some(cb) = callback else {
            return Err(Fail::arg("callback is NULL"));
        };
        let sd = with_model(model.id, "model", "fsdp_model_full_state_dict", |m| {
            on_stream(device(m), stream, || {
                Ok(m.fsdp.full_state_dict(FullStateDictConfig {
                    offload_to_cpu: true,
                    rank0_only,
                })?)
            })
        })?;
        for (name, t) in &sd.tensors {
            let shape: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
            let dl = describe(t, &shape)?;
            let c = CString::new(name.as_str())
                .map_err(|_| Fail::arg(format!("parameter name '{name}' contains NUL")))?;
            // SAFETY: the caller promises `cb` may be called with `ctx`; the name and
            // tensor it gets live until it returns.
            let r = unsafe { cb(ctx, c.as_ptr(), &dl) };
            if r != 0 {
                return Err(Fail::new(
                    FSDP_ERR_CALLBACK,
                    format!("the callback returned {r} for '{name}'; stopped there"),
                ));
            }
        }
        Ok(())
    })
}

fn checkpoint_type(t: i32) -> Res<StateDictType> {
    match t {
        FSDP_CHECKPOINT_SHARDED => Ok(StateDictType::Sharded),
        FSDP_CHECKPOINT_FULL => Ok(StateDictType::Full),
        t => Err(Fail::arg(format!(
            "type {t} is not an FSDP_CHECKPOINT_* value"
        ))),
    }
}

/// Saves the model and, unless `optimizer` is the null handle, its optimizer's state to
/// the directory `dir` (`type` an `FSDP_CHECKPOINT_*`), crash-safe: the previous
/// checkpoint of `dir` stays loadable until the new one is complete. A collective.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE` (also an optimizer of another model);
/// `FSDP_ERR_IO`, `FSDP_ERR_CHECKPOINT` naming the file; collective errors.
///
/// # Safety
/// `dir` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fsdp_checkpoint_save(
    model: fsdp_model_t,
    optimizer: fsdp_optimizer_t,
    dir: *const c_char,
    kind: i32,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_checkpoint_save", || {
        // SAFETY: the caller's promise.
        let dir = Path::new(unsafe { c_str(dir, "dir") }?);
        let ty = checkpoint_type(kind)?;
        let extra = serde_json::Value::Null;
        if optimizer.id == 0 {
            return with_model(model.id, "model", "fsdp_checkpoint_save", |m| {
                on_stream(device(m), stream, || {
                    Ok(save_checkpoint(dir, &mut m.fsdp, None, ty, extra)?)
                })
            });
        }
        with_optimizer(optimizer.id, "fsdp_checkpoint_save", |o, m| {
            same_model(o.model, model.id)?;
            on_stream(device(m), stream, || {
                Ok(save_checkpoint(
                    dir,
                    &mut m.fsdp,
                    Some(o.opt.as_ref()),
                    ty,
                    extra,
                )?)
            })
        })
    })
}

/// Loads the checkpoint in `dir` (a checkpoint directory, or a save directory's
/// `latest`) into the model and, unless `optimizer` is the null handle, the optimizer,
/// whatever world size and strategy it was saved at. A collective; nothing changes on
/// any rank unless every rank's part checked out.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_CHECKPOINT` (missing, truncated,
/// corrupted file), `FSDP_ERR_STATE_DICT` (names or shapes that do not fit),
/// `FSDP_ERR_PEER_FAILED` naming the rank that failed.
///
/// # Safety
/// `dir` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fsdp_checkpoint_load(
    model: fsdp_model_t,
    optimizer: fsdp_optimizer_t,
    dir: *const c_char,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_checkpoint_load", || {
        // SAFETY: the caller's promise.
        let dir = Path::new(unsafe { c_str(dir, "dir") }?);
        if optimizer.id == 0 {
            return with_model(model.id, "model", "fsdp_checkpoint_load", |m| {
                on_stream(device(m), stream, || {
                    load_checkpoint(dir, &mut m.fsdp, None)?;
                    Ok(())
                })
            });
        }
        with_optimizer(optimizer.id, "fsdp_checkpoint_load", |o, m| {
            same_model(o.model, model.id)?;
            on_stream(device(m), stream, || {
                load_checkpoint(dir, &mut m.fsdp, Some(o.opt.as_mut()))?;
                Ok(())
            })
        })
    })
}

fn same_model(opt_model: u64, model: u64) -> Res {
    if opt_model != model {
        return Err(Fail::new(
            super::FSDP_ERR_INVALID_HANDLE,
            "optimizer belongs to another model",
        ));
    }
    Ok(())
}
