//! Process groups and collectives on `DLTensor`s: `init_process_group` (torchrun's
//! environment, or an explicit rank, world size and init method, where `threads://NAME`
//! lets a C program run its ranks as its own threads), `new_group`, destroy, and
//! `all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`, `broadcast`, `barrier`.
//!
//! The collectives take host memory (`kDLCPU`, `stream` NULL) or device memory
//! (`kDLCUDA`, `stream` the host's `CUstream` on that device or NULL for the legacy
//! stream), every tensor of one call on one device. They copy the host's tensor into an
//! fsdp tensor of the same device, run the group's collective there, and write the result
//! back into the host's buffer, which is what "in place" means here (`torch.distributed`'s
//! in-place contract: the output is the caller's buffer; the copy is what the `tcp`
//! backend makes on the wire anyway). On a device the copies are queued on fsdp's stream,
//! ordered after the host's stream and the host's after them (`device.rs`).

use super::device::on_stream;
use super::dlpack::{DLTensor, ExtTensor};
use super::handles::{self, fsdp_group_t, Object};
use super::{c_str, fsdp_status, guard, write_out, Fail, Res, FSDP_ERR_INVALID_HANDLE};
use fsdp::distributed::{self, Group, InitOptions, ReduceOp};
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::Duration;

/// `ReduceOp.SUM`.
pub const FSDP_REDUCE_SUM: i32 = 0;
/// `ReduceOp.AVG`: the sum divided by the group size.
pub const FSDP_REDUCE_AVG: i32 = 1;
/// `ReduceOp.MAX` (`fsdp_all_reduce` only).
pub const FSDP_REDUCE_MAX: i32 = 2;
/// `ReduceOp.MIN` (`fsdp_all_reduce` only).
pub const FSDP_REDUCE_MIN: i32 = 3;
/// `ReduceOp.PRODUCT` (`fsdp_all_reduce` only).
pub const FSDP_REDUCE_PRODUCT: i32 = 4;

/// Arguments of [`fsdp_init_process_group`], as `torch.distributed.init_process_group`'s.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct fsdp_init_options {
    /// `"threads"` (ranks are threads of this process), `"tcp"` or its alias `"gloo"`
    /// (ranks are processes meeting through a TCP store, as torchrun starts them); NULL:
    /// `"threads"` for a `threads://` init method, else `"tcp"`.
    pub backend: *const c_char,
    /// `"env://"` or NULL (`MASTER_ADDR`, `MASTER_PORT`), `"tcp://HOST:PORT"`, or
    /// `"threads://NAME"`: the threads of this process that give the same NAME join one
    /// world.
    pub init_method: *const c_char,
    /// This rank, `0..world_size`; negative: `RANK` from the environment.
    pub rank: i32,
    /// Number of ranks; negative: `WORLD_SIZE` from the environment. With both `rank`
    /// and `world_size` given and an `init_method`, the environment is not read at all.
    pub world_size: i32,
    /// Rendezvous and collective timeout in milliseconds; 0: the default (300 s). A rank
    /// that stops calling makes its peers' collectives fail after it, naming that rank.
    pub timeout_ms: u32,
}

/// What a group handle holds.
pub(crate) struct GroupObj {
    pub(crate) group: Group,
    /// The world group handle this subgroup was made from (`None`: this is a world).
    parent: Option<u64>,
    /// The thread that initialized this world (its default group there).
    owner: Option<ThreadId>,
}

/// The group of handle `h`, checked live (for a subgroup: its world too).
pub(crate) fn live_group(h: u64, what: &str) -> Res<Group> {
    let g = handles::group(h, what)?;
    if let Some(p) = g.parent {
        if !handles::is_live(p) {
            return Err(Fail::new(
                FSDP_ERR_INVALID_HANDLE,
                format!("{what}: the world group it was made from was destroyed"),
            ));
        }
    }
    Ok(g.group.clone())
}

fn reduce_op(op: i32, what: &str) -> Res<ReduceOp> {
    Ok(match op {
        FSDP_REDUCE_SUM => ReduceOp::Sum,
        FSDP_REDUCE_AVG => ReduceOp::Avg,
        FSDP_REDUCE_MAX => ReduceOp::Max,
        FSDP_REDUCE_MIN => ReduceOp::Min,
        FSDP_REDUCE_PRODUCT => ReduceOp::Product,
        _ => {
            return Err(Fail::arg(format!(
                "{what}: reduce op {op} is not an FSDP_REDUCE_* value"
            )))
        }
    })
}

/// Fills `*out` with the defaults: backend and init method NULL, rank and world size -1
/// (from the environment), timeout 0 (300 s).
///
/// Errors: `FSDP_ERR_INVALID_ARGUMENT` when `out` is NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of `fsdp_init_options`.
#[no_mangle]
pub unsafe extern "C" fn fsdp_init_options_default(out: *mut fsdp_init_options) -> fsdp_status {
    guard("fsdp_init_options_default", || {
        let v = fsdp_init_options {
            backend: std::ptr::null(),
            init_method: std::ptr::null(),
            rank: -1,
            world_size: -1,
            timeout_ms: 0,
        };
        // SAFETY: out is NULL or valid for a write (the caller's promise).
        unsafe { write_out(out, "out", v) }
    })
}

/// The `InitOptions` of `o` (NULL: backend `tcp`, everything from the environment).
///
/// # Safety
/// `o` is NULL or a valid `fsdp_init_options` whose strings are NULL or NUL-terminated.
unsafe fn init_options(o: *const fsdp_init_options) -> Res<InitOptions> {
    if o.is_null() {
        return Ok(InitOptions::new("tcp"));
    }
    // SAFETY: non-null, and the caller promises a valid fsdp_init_options.
    let o = unsafe { &*o };
    let method = match o.init_method.is_null() {
        true => None,
        // SAFETY: non-null; a NUL-terminated string (the caller's promise).
        false => Some(unsafe { c_str(o.init_method, "options.init_method") }?.to_string()),
    };
    let backend = match o.backend.is_null() {
        // SAFETY: as above.
        false => unsafe { c_str(o.backend, "options.backend") }?.to_string(),
        true if method
            .as_deref()
            .is_some_and(|m| m.starts_with("threads://")) =>
        {
            "threads".into()
        }
        true => "tcp".into(),
    };
    let explicit = o.rank >= 0 && o.world_size >= 0 && method.is_some();
    let mut opts = InitOptions::new(&backend);
    opts.init_method = method;
    opts.rank = (o.rank >= 0).then_some(o.rank as usize);
    opts.world_size = (o.world_size >= 0).then_some(o.world_size as usize);
    if explicit {
        opts.env = Some(HashMap::new());
    }
    if o.timeout_ms > 0 {
        opts.timeout = Some(Duration::from_millis(o.timeout_ms as u64));
    }
    Ok(opts)
}

/// `torch.distributed.init_process_group`: joins the calling thread to its world (blocks
/// until every rank has joined) and returns the world group in `*out`. `options` NULL:
/// backend `tcp` with everything from torchrun's environment (`RANK`, `WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT`, and `FSDP_JOB_ID`/`FSDP_JOB_SECRET` under `fsdp
/// launch`). The world belongs to the calling thread: destroy it there (a thread that
/// ends without destroying it leaves the world, and its peers' next collective fails
/// naming its rank).
///
/// Errors: `FSDP_ERR_INVALID_ARGUMENT` (a bad backend, init method, rank or world size,
/// a missing environment variable, the thread already in a world, `out` NULL),
/// `FSDP_ERR_TIMEOUT` naming the ranks that did not join, `FSDP_ERR_REFUSED`,
/// `FSDP_ERR_UNSUPPORTED` (`nccl` in a build without CUDA), `FSDP_ERR_IO`.
///
/// # Safety
/// `options` is NULL or a valid `fsdp_init_options` whose strings are NULL or
/// NUL-terminated; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_init_process_group(
    options: *const fsdp_init_options,
    out: *mut fsdp_group_t,
) -> fsdp_status {
    guard("fsdp_init_process_group", || {
        if out.is_null() {
            return Err(Fail::arg("out (the out-pointer) is NULL"));
        }
        // SAFETY: the caller's promise on `options`.
        let opts = unsafe { init_options(options) }?;
        let group = distributed::init_process_group(opts)?;
        let id = handles::insert(Object::Group(Arc::new(GroupObj {
            group,
            parent: None,
            owner: Some(std::thread::current().id()),
        })));
        // SAFETY: checked non-null; valid for a write (the caller's promise).
        unsafe { write_out(out, "out", fsdp_group_t { id }) }
    })
}

/// `torch.distributed.new_group(ranks)`: a group of the given world ranks (`n` of them at
/// `ranks`), made from `group`'s world. Every member calls it, in the same order as its
/// other `fsdp_new_group` calls; `*out` is the null handle (`id` 0) on a rank that is not a
/// member.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for repeated or
/// out-of-range ranks, `ranks` NULL with `n` > 0, `out` NULL.
///
/// # Safety
/// `ranks` is valid for `n` reads; `out` for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_new_group(
    group: fsdp_group_t,
    ranks: *const i32,
    n: usize,
    out: *mut fsdp_group_t,
) -> fsdp_status {
    guard("fsdp_new_group", || {
        let g = handles::group(group.id, "group")?;
        let pg = live_group(group.id, "group")?;
        if ranks.is_null() && n > 0 {
            return Err(Fail::arg("ranks is NULL"));
        }
        let list: Vec<usize> = (0..n)
            // SAFETY: ranks is valid for n reads (the caller's promise).
            .map(|i| unsafe { *ranks.add(i) })
            .map(|r| usize::try_from(r).map_err(|_| Fail::arg(format!("rank {r} is negative"))))
            .collect::<Res<_>>()?;
        let sub = pg.new_group(&list)?;
        let id = match sub {
            Some(s) => handles::insert(Object::Group(Arc::new(GroupObj {
                group: s,
                parent: Some(g.parent.unwrap_or(group.id)),
                owner: None,
            }))),
            None => 0,
        };
        // SAFETY: valid for a write (the caller's promise); NULL is refused.
        unsafe { write_out(out, "out", fsdp_group_t { id }) }
    })
}

/// Destroys a group handle. For a world group (`fsdp_init_process_group`'s), this rank
/// leaves the world (`torch.distributed.destroy_process_group()`): peers waiting for it
/// fail at once naming it; call it on the thread that initialized the world. Groups made
/// from that world, and models built on any of them, are refused afterwards.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE` (NULL, freed, already destroyed); `FSDP_ERR_USAGE`
/// for a world destroyed from another thread than its own.
#[no_mangle]
pub extern "C" fn fsdp_destroy_process_group(group: fsdp_group_t) -> fsdp_status {
    guard("fsdp_destroy_process_group", || {
        let g = handles::group(group.id, "group")?;
        if let Some(owner) = g.owner {
            if owner != std::thread::current().id() {
                return Err(Fail::new(
                    super::FSDP_ERR_USAGE,
                    "a world group is destroyed on the thread that called fsdp_init_process_group (it is that thread's default group)",
                ));
            }
            let same = distributed::default_group()
                .ok()
                .is_some_and(|d| std::ptr::addr_eq(Arc::as_ptr(&d), Arc::as_ptr(&g.group)));
            handles::remove(group.id, handles::Kind::Group, "group")?;
            if same {
                distributed::destroy_process_group()?;
            }
            return Ok(());
        }
        handles::remove(group.id, handles::Kind::Group, "group")?;
        Ok(())
    })
}

/// This rank's index in `group` (`dist.get_rank(group)`) in `*rank`.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`, `FSDP_ERR_INVALID_ARGUMENT` (`rank` NULL).
///
/// # Safety
/// `rank` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_group_rank(group: fsdp_group_t, rank: *mut i32) -> fsdp_status {
    guard("fsdp_group_rank", || {
        let g = live_group(group.id, "group")?;
        // SAFETY: the caller's promise.
        unsafe { write_out(rank, "rank", g.rank() as i32) }
    })
}

/// Number of ranks in `group` (`dist.get_world_size(group)`) in `*size`.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`, `FSDP_ERR_INVALID_ARGUMENT` (`size` NULL).
///
/// # Safety
/// `size` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_group_size(group: fsdp_group_t, size: *mut i32) -> fsdp_status {
    guard("fsdp_group_size", || {
        let g = live_group(group.id, "group")?;
        // SAFETY: the caller's promise.
        unsafe { write_out(size, "size", g.size() as i32) }
    })
}

/// In place: `tensor = op over ranks of tensor` (`dist.all_reduce`). Any dtype fsdp has
/// (float32, float16, bfloat16, int32), any shape, the same on every rank; `op` an
/// `FSDP_REDUCE_*`. Host memory with `stream` NULL, or device memory (`kDLCUDA`) with the
/// host's stream on that device (NULL: the legacy stream).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`, `FSDP_ERR_INVALID_ARGUMENT` (bad tensor, op, or a
/// stream with host memory), `FSDP_ERR_DTYPE_MISMATCH`, `FSDP_ERR_COLLECTIVE_MISMATCH`
/// (ranks disagree), `FSDP_ERR_TIMEOUT`, `FSDP_ERR_PEER_FAILED`, `FSDP_ERR_UNSUPPORTED`
/// (device memory in a build without CUDA), `FSDP_ERR_CUDA`.
///
/// # Safety
/// `tensor` describes memory valid for reads and writes (in stream order on a device).
#[no_mangle]
pub unsafe extern "C" fn fsdp_all_reduce(
    group: fsdp_group_t,
    tensor: *mut DLTensor,
    op: i32,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_all_reduce", || {
        let g = live_group(group.id, "group")?;
        let op = reduce_op(op, "op")?;
        // SAFETY: the caller's promise on `tensor`.
        unsafe { in_place(tensor, stream, |t| Ok(g.all_reduce(t, op)?)) }
    })
}

/// `output (world * n) = concat over ranks of input (n)`, in rank order
/// (`dist.all_gather_into_tensor`), written into the host's `output`. Same dtype and
/// device for both; `output` has `group size` times `input`'s elements. `stream` as
/// [`fsdp_all_reduce`]'s.
///
/// Errors: as [`fsdp_all_reduce`]; `FSDP_ERR_SHAPE_MISMATCH` for the sizes,
/// `FSDP_ERR_DEVICE_MISMATCH` for tensors on two devices.
///
/// # Safety
/// `output` describes memory valid for writes, `input` for reads; they do not overlap.
#[no_mangle]
pub unsafe extern "C" fn fsdp_all_gather_into_tensor(
    group: fsdp_group_t,
    output: *mut DLTensor,
    input: *const DLTensor,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_all_gather_into_tensor", || {
        let g = live_group(group.id, "group")?;
        // SAFETY: the caller's promises on both tensors.
        let (o, i) = unsafe {
            (
                ExtTensor::check(output, "output")?,
                ExtTensor::check(input, "input")?,
            )
        };
        i.expect_device(o.device, "output is")?;
        o.expect_dtype(i.dtype)?;
        sizes(
            o.numel(),
            i.numel() * g.size(),
            "output",
            "group size x input",
        )?;
        on_stream(o.device, stream, || {
            // SAFETY: readable (the caller's promise); the output is overwritten whole.
            let ti = unsafe { i.to_tensor() }?;
            let to = fsdp::tensor::Tensor::zeros_on(&o.shape, o.dtype, o.device)?;
            g.all_gather_into_tensor(&to, &ti)?;
            // SAFETY: writable (the caller's promise), the collective is over.
            unsafe { o.write_from(&to) }
        })
    })
}

/// `output (n) = op over ranks of input[rank * n .. (rank + 1) * n]`, `input` of
/// `group size * n` elements (`dist.reduce_scatter_tensor`), written into the host's
/// `output`; `op` `FSDP_REDUCE_SUM` or `FSDP_REDUCE_AVG`. `stream` as
/// [`fsdp_all_reduce`]'s.
///
/// Errors: as [`fsdp_all_gather_into_tensor`].
///
/// # Safety
/// As [`fsdp_all_gather_into_tensor`].
#[no_mangle]
pub unsafe extern "C" fn fsdp_reduce_scatter_tensor(
    group: fsdp_group_t,
    output: *mut DLTensor,
    input: *const DLTensor,
    op: i32,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_reduce_scatter_tensor", || {
        let g = live_group(group.id, "group")?;
        let op = reduce_op(op, "op")?;
        // SAFETY: the caller's promises on both tensors.
        let (o, i) = unsafe {
            (
                ExtTensor::check(output, "output")?,
                ExtTensor::check(input, "input")?,
            )
        };
        i.expect_device(o.device, "output is")?;
        o.expect_dtype(i.dtype)?;
        sizes(
            i.numel(),
            o.numel() * g.size(),
            "input",
            "group size x output",
        )?;
        on_stream(o.device, stream, || {
            // SAFETY: readable (the caller's promise); the output is overwritten whole.
            let ti = unsafe { i.to_tensor() }?;
            let to = fsdp::tensor::Tensor::zeros_on(&o.shape, o.dtype, o.device)?;
            g.reduce_scatter_tensor(&to, &ti, op)?;
            // SAFETY: writable (the caller's promise), the collective is over.
            unsafe { o.write_from(&to) }
        })
    })
}

/// In place: every rank's `tensor` becomes rank `src`'s (`dist.broadcast`; `src` a rank
/// of `group`). `stream` as [`fsdp_all_reduce`]'s.
///
/// Errors: as [`fsdp_all_reduce`].
///
/// # Safety
/// As [`fsdp_all_reduce`].
#[no_mangle]
pub unsafe extern "C" fn fsdp_broadcast(
    group: fsdp_group_t,
    tensor: *mut DLTensor,
    src: i32,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_broadcast", || {
        let g = live_group(group.id, "group")?;
        let src = usize::try_from(src)
            .ok()
            .filter(|&s| s < g.size())
            .ok_or_else(|| {
                Fail::arg(format!(
                    "src {src} is not a rank of a group of {}",
                    g.size()
                ))
            })?;
        // SAFETY: the caller's promise on `tensor`.
        unsafe { in_place(tensor, stream, |t| Ok(g.broadcast(t, src)?)) }
    })
}

/// Returns once every rank of `group` has called it (`dist.barrier`).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`, `FSDP_ERR_TIMEOUT`, `FSDP_ERR_PEER_FAILED`.
#[no_mangle]
pub extern "C" fn fsdp_barrier(group: fsdp_group_t) -> fsdp_status {
    guard("fsdp_barrier", || {
        live_group(group.id, "group")?.barrier()?;
        Ok(())
    })
}

fn sizes(got: usize, want: usize, what: &str, of: &str) -> Res {
    if got != want {
        return Err(Fail::new(
            super::FSDP_ERR_SHAPE_MISMATCH,
            format!("{what} has {got} elements, expected {want} ({of})"),
        ));
    }
    Ok(())
}

/// The in-place collectives (all-reduce, broadcast): the host's `tensor` is read into a
/// tensor on its device, `run` on it, and written back, ordered on `stream`.
///
/// # Safety
/// `tensor` describes memory valid for reads and writes.
unsafe fn in_place(
    tensor: *mut DLTensor,
    stream: *mut c_void,
    run: impl FnOnce(&fsdp::tensor::Tensor) -> Res,
) -> Res {
    // SAFETY: the caller's promise on `tensor`.
    let h = unsafe { ExtTensor::check(tensor, "tensor") }?;
    on_stream(h.device, stream, || {
        // SAFETY: readable (the caller's promise).
        let t = unsafe { h.to_tensor() }?;
        run(&t)?;
        // SAFETY: writable, and the collective is over, so nothing else accesses it.
        unsafe { h.write_from(&t) }
    })
}
