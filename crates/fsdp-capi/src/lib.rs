//! The C ABI of [`fsdp::embed`]: FSDP for a host in C, C++, Python (ctypes), Julia, ...
//! that keeps its own tensors, compute and autograd. The header is `include/fsdp.h` (in
//! this crate's folder, `crates/fsdp-capi/`), generated from this crate by cbindgen
//! (`tests/capi/header.rs` fails when it is stale, and reads it back with bindgen to check
//! every declaration against these functions). Built into `libfsdp_capi.so` (cdylib) and
//! `libfsdp_capi.a` (staticlib); it uses only the public API of the `fsdp` library.
//!
//! | concern | C | file |
//! |---|---|---|
//! | status codes, `fsdp_last_error`, the entry-point guard | `fsdp_status`, `FSDP_ERR_*` | `lib.rs` |
//! | opaque handles with generation counters | `fsdp_group_t`, `fsdp_spec_t`, `fsdp_model_t`, `fsdp_unit_t`, `fsdp_optimizer_t` | `handles.rs` |
//! | DLPack tensors (v0.8/1.0 layout), host or device memory | `DLTensor`, `DLDevice`, `DLDataType` | `dlpack.rs` |
//! | the host's CUDA stream ordered with fsdp's, device copies | every `stream` argument | `device.rs` |
//! | process groups and collectives | `fsdp_init_process_group`, `fsdp_new_group`, `fsdp_all_reduce`, ... | `group.rs` |
//! | declaring units, the config subset | `fsdp_spec_*`, `fsdp_config` | `spec.rs` |
//! | building the model, units and their parameters | `fsdp_model_new`, `fsdp_model_unit` | `model.rs` |
//! | the hooks, `no_sync`, `clip_grad_norm_` | `fsdp_unit_pre_forward`, ..., `fsdp_model_finish_backward` | `hooks.rs` |
//! | optimizers | `fsdp_optimizer_new`, `fsdp_optimizer_step` | `optim.rs` |
//! | state dict and checkpoints | `fsdp_model_full_state_dict`, `fsdp_checkpoint_save`, `fsdp_checkpoint_load` | `state.rs` |
//! | the words of messages that reach C (header names, no repeated prefix) | `fsdp_last_error` | `words.rs` |
//!
//! Every function returns an [`fsdp_status`]: [`FSDP_OK`] (0) or one `FSDP_ERR_*` code per
//! error class of [`fsdp::Error`] (plus [`FSDP_ERR_INVALID_HANDLE`], [`FSDP_ERR_CALLBACK`]
//! and [`FSDP_ERR_PANIC`]); [`fsdp_last_error`] gives the calling thread's message. No
//! panic crosses the boundary: each entry point runs under `catch_unwind`, and a model
//! whose call panicked half-way is refused afterwards instead of being used inconsistent.
//!
//! Devices and streams: a model computes where `fsdp_config.device` says (`kDLCPU` or
//! `kDLCUDA`), and its hooks hand out and take tensors of that device. Every call that
//! touches tensor memory takes the host's stream (a `CUstream`/`cudaStream_t` as `void
//! *`): NULL on the CPU; on a CUDA device the host's stream (NULL: the legacy default
//! stream), which fsdp orders its own streams after at entry and orders after its own
//! work at exit, with events (`device.rs`), so neither side synchronizes the device.
//! The collectives take host or device tensors alike.
//!
//! Semantics: FSDP2's `fully_shard` hooks (`FSDPParamGroup.pre_forward`, ...:
//! `_fsdp_param_group.py`) and its stream discipline; Horovod's split between a C core
//! that communicates and a host that computes (`horovod/common/operations.cc`).

#![warn(missing_docs)]

mod device;
mod dlpack;
mod group;
mod handles;
mod hooks;
mod model;
mod optim;
mod spec;
mod state;
mod words;

pub use dlpack::*;
pub use group::*;
pub use handles::*;
pub use hooks::*;
pub use model::*;
pub use optim::*;
pub use spec::*;
pub use state::*;

use fsdp::error::Error;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};

/// What every function returns: [`FSDP_OK`] (0) or an `FSDP_ERR_*` code; the message is
/// [`fsdp_last_error`].
#[allow(non_camel_case_types)]
pub type fsdp_status = i32;

/// Success.
pub const FSDP_OK: fsdp_status = 0;
/// An argument out of range: a NULL pointer, a bad enum value, a name that is not UTF-8,
/// an unknown unit or option (`fsdp::Error::InvalidArgument`).
pub const FSDP_ERR_INVALID_ARGUMENT: fsdp_status = 1;
/// A handle that is NULL (0), freed (its generation is gone), of another kind (a group
/// passed as a model), or whose process group was destroyed.
pub const FSDP_ERR_INVALID_HANDLE: fsdp_status = 2;
/// Shapes or element counts that had to agree did not (`ShapeMismatch`).
pub const FSDP_ERR_SHAPE_MISMATCH: fsdp_status = 3;
/// A tensor of a dtype the call does not take (`DTypeMismatch`).
pub const FSDP_ERR_DTYPE_MISMATCH: fsdp_status = 4;
/// A tensor on another device than the call needs (`DeviceMismatch`).
pub const FSDP_ERR_DEVICE_MISMATCH: fsdp_status = 5;
/// A parameter read while its unit is sharded (`NotMaterialized`).
pub const FSDP_ERR_NOT_MATERIALIZED: fsdp_status = 6;
/// FSDP used in a way it does not support: hooks, steps or `zero_grad` out of the
/// contract's order (see the top of this header; the message names what was expected),
/// options that do not fit together (`fsdp::Error::Fsdp`).
pub const FSDP_ERR_USAGE: fsdp_status = 7;
/// A backward without its forward (`NoSavedForward`).
pub const FSDP_ERR_NO_SAVED_FORWARD: fsdp_status = 8;
/// The ranks of a group called different collectives or sizes, or declared different
/// models to `fsdp_model_new` (`CollectiveMismatch`).
pub const FSDP_ERR_COLLECTIVE_MISMATCH: fsdp_status = 9;
/// A collective or the rendezvous did not complete in time; the message names the ranks
/// that never arrived (`Timeout`).
pub const FSDP_ERR_TIMEOUT: fsdp_status = 10;
/// Another rank failed or left; the message names it and its reason (`PeerFailed`).
pub const FSDP_ERR_PEER_FAILED: fsdp_status = 11;
/// A call that needs a process group before one exists (`NotInitialized`).
pub const FSDP_ERR_NOT_INITIALIZED: fsdp_status = 12;
/// A feature this build does not have: CUDA tensors or devices without the `cuda`
/// feature, a backend, managed memory (`Unsupported`).
pub const FSDP_ERR_UNSUPPORTED: fsdp_status = 13;
/// The CUDA backend failed (`Cuda`).
pub const FSDP_ERR_CUDA: fsdp_status = 14;
/// A state dict that does not fit the model (`StateDict`).
pub const FSDP_ERR_STATE_DICT: fsdp_status = 15;
/// A checkpoint file or directory that cannot be used (`Checkpoint`).
pub const FSDP_ERR_CHECKPOINT: fsdp_status = 16;
/// A rendezvous connection refused: another job, or a wrong job secret (`Refused`).
pub const FSDP_ERR_REFUSED: fsdp_status = 17;
/// Operating-system I/O (`Io`).
pub const FSDP_ERR_IO: fsdp_status = 18;
/// Training data that cannot be used (`Data`).
pub const FSDP_ERR_DATA: fsdp_status = 19;
/// A host callback returned non-zero; the call stopped there.
pub const FSDP_ERR_CALLBACK: fsdp_status = 20;
/// An internal error (a Rust panic caught at the boundary). A model whose call panicked
/// is refused from then on (`FSDP_ERR_INVALID_HANDLE`): free it.
pub const FSDP_ERR_PANIC: fsdp_status = 21;
/// Host memory for something whose size the host chose (a declared parameter's shard, a
/// gather or gradient buffer, optimizer state, a copy of a host tensor) could not be
/// allocated; the message names the bytes and what they were for. Nothing changed and the
/// process goes on: free memory, or declare a smaller model or more ranks
/// (`OutOfMemory`). Device memory that runs out is `FSDP_ERR_CUDA`.
pub const FSDP_ERR_OUT_OF_MEMORY: fsdp_status = 22;

/// Version of this C ABI: bumped on every incompatible change of `include/fsdp.h`
/// (2: `fsdp_config.device`, CUDA tensors and streams, 16-bit parameter views under
/// mixed precision).
pub const FSDP_ABI_VERSION: u32 = 2;

/// A failed call: its status and message.
#[derive(Debug)]
pub(crate) struct Fail {
    pub(crate) status: fsdp_status,
    pub(crate) msg: String,
}

impl Fail {
    pub(crate) fn new(status: fsdp_status, msg: impl Into<String>) -> Fail {
        Fail {
            status,
            msg: msg.into(),
        }
    }

    pub(crate) fn arg(msg: impl Into<String>) -> Fail {
        Fail::new(FSDP_ERR_INVALID_ARGUMENT, msg)
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        let status = match &e {
            Error::ShapeMismatch { .. } => FSDP_ERR_SHAPE_MISMATCH,
            Error::DTypeMismatch { .. } => FSDP_ERR_DTYPE_MISMATCH,
            Error::NotMaterialized { .. } => FSDP_ERR_NOT_MATERIALIZED,
            Error::NoSavedForward { .. } => FSDP_ERR_NO_SAVED_FORWARD,
            Error::InvalidArgument(_) => FSDP_ERR_INVALID_ARGUMENT,
            Error::CollectiveMismatch { .. } => FSDP_ERR_COLLECTIVE_MISMATCH,
            Error::Timeout { .. } => FSDP_ERR_TIMEOUT,
            Error::PeerFailed { .. } => FSDP_ERR_PEER_FAILED,
            Error::NotInitialized { .. } => FSDP_ERR_NOT_INITIALIZED,
            Error::Fsdp(_) => FSDP_ERR_USAGE,
            Error::Data(_) => FSDP_ERR_DATA,
            Error::DeviceMismatch { .. } => FSDP_ERR_DEVICE_MISMATCH,
            Error::Unsupported(_) => FSDP_ERR_UNSUPPORTED,
            Error::Cuda { .. } => FSDP_ERR_CUDA,
            Error::StateDict(_) => FSDP_ERR_STATE_DICT,
            Error::Checkpoint { .. } => FSDP_ERR_CHECKPOINT,
            Error::Refused { .. } => FSDP_ERR_REFUSED,
            Error::Io { .. } => FSDP_ERR_IO,
            Error::OutOfMemory { .. } => FSDP_ERR_OUT_OF_MEMORY,
        };
        Fail::new(status, e.to_string())
    }
}

/// What an entry point's body returns.
pub(crate) type Res<T = ()> = Result<T, Fail>;

thread_local! {
    /// The message of this thread's last failed call (empty before any).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    // Interior NULs would truncate the C string: replace them.
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs an entry point's body under [`Api::C`](fsdp::error::Api) (errors name
/// `include/fsdp.h`'s functions and fields): its status, the message stored for
/// [`fsdp_last_error`], and a caught panic turned into [`FSDP_ERR_PANIC`] (no unwinding
/// crosses into C).
pub(crate) fn guard(call: &'static str, body: impl FnOnce() -> Res) -> fsdp_status {
    // Messages made inside name the header's functions and fields, not the Rust API's.
    let _c = fsdp::error::Api::C.enter();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Ok(())) => FSDP_OK,
        Ok(Err(f)) => {
            set_last_error(&words::for_c(call, &f.msg));
            f.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("{call}: internal error (panic): {what}"));
            FSDP_ERR_PANIC
        }
    }
}

/// The UTF-8 string at `s`, argument `what`.
///
/// # Safety
/// `s` is NULL or points to a NUL-terminated string that lives for `'a`.
pub(crate) unsafe fn c_str<'a>(s: *const c_char, what: &str) -> Res<&'a str> {
    if s.is_null() {
        return Err(Fail::arg(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the caller promises a NUL-terminated string living for 'a.
    let c = unsafe { CStr::from_ptr(s) };
    c.to_str()
        .map_err(|_| Fail::arg(format!("{what} is not valid UTF-8")))
}

/// Writes `v` through the out-pointer `out`, argument `what`.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn write_out<T>(out: *mut T, what: &str, v: T) -> Res {
    if out.is_null() {
        return Err(Fail::arg(format!("{what} (the out-pointer) is NULL")));
    }
    // SAFETY: non-null, and the caller promises it is valid for writes of T.
    unsafe { out.write(v) };
    Ok(())
}

/// The message of the calling thread's last failed call, prefixed with the function's
/// name (`"fsdp_unit_post_backward: fsdp: post_backward on unit '2' without pre_backward
/// first: ..."`); `""` when no call of this thread has failed. A successful call leaves
/// it as it was. The pointer stays valid until the next failing call on this thread.
#[no_mangle]
pub extern "C" fn fsdp_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The name of a status code (`"FSDP_ERR_PEER_FAILED"`), a static string;
/// `"FSDP_ERR_UNKNOWN"` for a code this library does not return.
#[no_mangle]
pub extern "C" fn fsdp_status_name(status: fsdp_status) -> *const c_char {
    let s: &'static CStr = match status {
        FSDP_OK => c"FSDP_OK",
        FSDP_ERR_INVALID_ARGUMENT => c"FSDP_ERR_INVALID_ARGUMENT",
        FSDP_ERR_INVALID_HANDLE => c"FSDP_ERR_INVALID_HANDLE",
        FSDP_ERR_SHAPE_MISMATCH => c"FSDP_ERR_SHAPE_MISMATCH",
        FSDP_ERR_DTYPE_MISMATCH => c"FSDP_ERR_DTYPE_MISMATCH",
        FSDP_ERR_DEVICE_MISMATCH => c"FSDP_ERR_DEVICE_MISMATCH",
        FSDP_ERR_NOT_MATERIALIZED => c"FSDP_ERR_NOT_MATERIALIZED",
        FSDP_ERR_USAGE => c"FSDP_ERR_USAGE",
        FSDP_ERR_NO_SAVED_FORWARD => c"FSDP_ERR_NO_SAVED_FORWARD",
        FSDP_ERR_COLLECTIVE_MISMATCH => c"FSDP_ERR_COLLECTIVE_MISMATCH",
        FSDP_ERR_TIMEOUT => c"FSDP_ERR_TIMEOUT",
        FSDP_ERR_PEER_FAILED => c"FSDP_ERR_PEER_FAILED",
        FSDP_ERR_NOT_INITIALIZED => c"FSDP_ERR_NOT_INITIALIZED",
        FSDP_ERR_UNSUPPORTED => c"FSDP_ERR_UNSUPPORTED",
        FSDP_ERR_CUDA => c"FSDP_ERR_CUDA",
        FSDP_ERR_STATE_DICT => c"FSDP_ERR_STATE_DICT",
        FSDP_ERR_CHECKPOINT => c"FSDP_ERR_CHECKPOINT",
        FSDP_ERR_REFUSED => c"FSDP_ERR_REFUSED",
        FSDP_ERR_IO => c"FSDP_ERR_IO",
        FSDP_ERR_DATA => c"FSDP_ERR_DATA",
        FSDP_ERR_CALLBACK => c"FSDP_ERR_CALLBACK",
        FSDP_ERR_PANIC => c"FSDP_ERR_PANIC",
        FSDP_ERR_OUT_OF_MEMORY => c"FSDP_ERR_OUT_OF_MEMORY",
        _ => c"FSDP_ERR_UNKNOWN",
    };
    s.as_ptr()
}

/// [`FSDP_ABI_VERSION`] of the loaded library: compare it with the header's to catch a
/// host built against another version.
#[no_mangle]
pub extern "C" fn fsdp_abi_version() -> u32 {
    FSDP_ABI_VERSION
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: fsdp_last_error returns a valid NUL-terminated string of this thread.
        unsafe { CStr::from_ptr(fsdp_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_is_a_status_and_a_message_never_an_unwind() {
        assert_eq!(guard("fsdp_x", || panic!("boom {}", 7)), FSDP_ERR_PANIC);
        assert_eq!(last(), "fsdp_x: internal error (panic): boom 7");
        // A successful call leaves the message; a failing one replaces it.
        assert_eq!(guard("fsdp_y", || Ok(())), FSDP_OK);
        assert_eq!(last(), "fsdp_x: internal error (panic): boom 7");
        let s = guard("fsdp_z", || Err(Error::Fsdp("no\0nul".into()).into()));
        assert_eq!(s, FSDP_ERR_USAGE);
        assert_eq!(last(), "fsdp_z: fsdp: no\\0nul");
        // SAFETY: a static string.
        let name = unsafe { CStr::from_ptr(fsdp_status_name(s)) };
        assert_eq!(name.to_str().unwrap(), "FSDP_ERR_USAGE");
    }
}
