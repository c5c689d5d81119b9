//! The hooks around the host's compute of each unit, and the root's gradient utilities
//! (`no_sync`, `clip_grad_norm_`, `zero_grad`). The order, as
//! [`FullyShardedDataParallel::pre_forward`](fsdp::fsdp::FullyShardedDataParallel::pre_forward)
//! documents it:
//!
//! ```text
//! forward, units in the host's order (the root's pre_forward first, its post_forward last):
//!     fsdp_unit_pre_forward(u, 1, params)  -> compute with params -> fsdp_unit_post_forward(u, 1)
//! backward, in reverse:
//!     fsdp_unit_pre_backward(u, params, grads) -> add d loss / d param into grads (or give
//!     your own gradients to post_backward)     -> fsdp_unit_post_backward(u, NULL or grads, n, 1)
//! once, after the root's post_backward:  fsdp_model_finish_backward(model)
//! ```
//!
//! Views point into fsdp's buffers, on the model's device (`kDLCPU`, or `kDLCUDA` with
//! its `device_id`): parameter views are read-only, of the parameter dtype (float32, or
//! the `param_dtype` under mixed precision), gradient views are float32 buffers the host
//! adds into (`+=`); both stay valid until the unit's matching post hook (the host must
//! not use them after it, and on a CUDA device not in work queued on its stream after
//! that call). Each call orders fsdp's streams after the host's `stream` and the host's
//! after fsdp's (`device.rs`).

use super::device::on_stream;
use super::dlpack::{describe, empty_tensor, write_views, DLTensor, ExtTensor};
use super::handles::{fsdp_model_t, fsdp_unit_t};
use super::model::{with_model, with_unit, HeldView, ModelObj, ViewKind};
use super::{fsdp_status, guard, write_out, Fail, Res, FSDP_ERR_USAGE};
use fsdp::backend::Device;
use fsdp::tensor::{DType, Tensor};
use std::ffi::c_void;

/// The device the model computes on (`fsdp_config.device`).
pub(crate) fn device(m: &ModelObj) -> Device {
    m.fsdp.compute_device()
}

/// The dtype of parameter views: `param_dtype` under mixed precision, else float32.
fn view_dtype(m: &ModelObj) -> DType {
    m.fsdp.mixed_precision().compute_dtype()
}

/// Calls `f` on unit `index` of `m` (the FSDP unit itself).
fn on_unit<R>(
    m: &mut ModelObj,
    index: usize,
    f: impl FnOnce(&mut fsdp::fsdp::FullyShardedDataParallel) -> fsdp::Result<R>,
) -> Res<R> {
    let name = m.units[index].name.clone();
    Ok(m.fsdp.with_unit(&name, f)??)
}

/// The unit's full parameters as fsdp tensors, in declaration order (checked by name).
fn params(m: &mut ModelObj, index: usize) -> Res<Vec<Tensor>> {
    let views = on_unit(m, index, |u| u.param_views())?;
    let meta = &m.units[index].params;
    if views.len() != meta.len() || views.iter().zip(meta).any(|((n, _), p)| *n != p.fqn) {
        return Err(Fail::arg(format!(
            "internal: unit '{}' has parameters {:?}",
            m.units[index].name,
            views.iter().map(|(n, _)| n).collect::<Vec<_>>()
        )));
    }
    Ok(views.into_iter().map(|(_, t)| t).collect())
}

/// The unit's gradient views, aligned with its parameters (`None` for frozen ones).
/// The gradient views of unit `index` as the host sees them: float32 under every
/// precision. Under low-precision mixed precision the unit's gradients are `param_dtype`
/// tensors, so the host gets float32 buffers (made at the first call of a backward, the
/// same ones after), folded into them by [`fold_f32_grads`].
fn grad_tensors(m: &mut ModelObj, index: usize) -> Res<Vec<Option<Tensor>>> {
    let mut views = on_unit(m, index, |u| u.grad_views())?;
    if views
        .iter()
        .any(|(_, t)| t.dtype() != DType::F32 && t.dtype() != DType::F64)
    {
        let held = &mut m.units[index].grad_f32;
        if held.is_empty() {
            for (_, t) in &views {
                held.push((
                    Tensor::zeros_on(t.shape(), DType::F32, t.device())?,
                    t.clone(),
                ));
            }
        }
        for ((_, t), (f, _)) in views.iter_mut().zip(held.iter()) {
            *t = f.clone();
        }
    }
    Ok(m.units[index]
        .params
        .iter()
        .map(|p| {
            views
                .iter()
                .find(|(n, _)| *n == p.fqn)
                .map(|(_, t)| t.clone())
        })
        .collect())
}

/// Adds the float32 gradients the host wrote (or fsdp added) into unit `index`'s
/// `param_dtype` gradients, one rounding each, and forgets them.
fn fold_f32_grads(m: &mut ModelObj, index: usize) -> Res {
    for (f, g) in std::mem::take(&mut m.units[index].grad_f32) {
        fsdp::ops::add_promoted_(&g, &f)?;
    }
    Ok(())
}

fn describe_all(m: &ModelObj, index: usize, ts: &[Option<Tensor>]) -> Res<Vec<DLTensor>> {
    ts.iter()
        .zip(&m.units[index].params)
        .map(|(t, p)| match t {
            Some(t) => describe(t, &p.shape),
            None => Ok(empty_tensor()),
        })
        .collect()
}

fn check_len(out: *const DLTensor, n: usize, m: &ModelObj, index: usize, what: &str) -> Res {
    let have = m.units[index].params.len();
    if !out.is_null() && n != have {
        return Err(Fail::new(
            super::FSDP_ERR_SHAPE_MISMATCH,
            format!(
                "{what}: the array holds {n} DLTensors but unit '{}' has {have} parameters (fsdp_unit_num_params)",
                m.units[index].name
            ),
        ));
    }
    Ok(())
}

/// Before the unit's forward (FSDP2 `FSDPParamGroup.pre_forward`): all-gathers its
/// parameters (or takes the prefetched gather) and, when `params` is not NULL, fills
/// `params[0..n]` with `DLTensor` views of the full parameters in declaration order, on
/// the model's device (read-only; valid until `fsdp_unit_post_forward`; compact
/// row-major: `strides` NULL, `byte_offset` 0). The root's pre_forward comes first in a
/// step's forward, before every other unit's. Their dtype is
/// float32, or under `mixed_precision` its 16-bit dtype (`kDLBfloat`/`kDLFloat`, 16 bits:
/// a cast of the gathered values owned by the unit). `grad_enabled` 0 is
/// `torch.no_grad()`: the parameters are freed again at post_forward. `n` must be
/// `fsdp_unit_num_params`. On error the unit is sharded again and needs no post_forward.
/// `stream`: NULL on the CPU; on a CUDA device the host's stream, which waits for the
/// views before its later work reads them.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` (`stream` not NULL on
/// the CPU); `FSDP_ERR_SHAPE_MISMATCH` (`n`); `FSDP_ERR_USAGE` (twice without
/// post_forward; on the root inside an unfinished backward; on any unit after the root's
/// `fsdp_unit_post_backward` without `fsdp_model_finish_backward`); the all-gather's
/// `FSDP_ERR_TIMEOUT`, `FSDP_ERR_PEER_FAILED`, ...; `FSDP_ERR_OUT_OF_MEMORY` (the gathered
/// parameters do not fit in host memory); `FSDP_ERR_CUDA` (a stream of another device, a
/// failed copy, device memory).
///
/// # Safety
/// `params` is NULL or valid for writes of `n` `DLTensor`s.
#[no_mangle]
pub unsafe extern "C" fn fsdp_unit_pre_forward(
    unit: fsdp_unit_t,
    grad_enabled: bool,
    params: *mut DLTensor,
    n: usize,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_unit_pre_forward", || {
        with_unit(unit.id, "fsdp_unit_pre_forward", |m, i| {
            on_stream(device(m), stream, || {
                pre_forward(m, i, grad_enabled, params, n)
            })
        })
    })
}

/// # Safety
/// As [`fsdp_unit_pre_forward`].
unsafe fn pre_forward(
    m: &mut ModelObj,
    i: usize,
    grad_enabled: bool,
    params: *mut DLTensor,
    n: usize,
) -> Res {
    check_len(params, n, m, i, "params")?;
    on_unit(m, i, |u| u.pre_forward(grad_enabled))?;
    let views = params_views(m, i);
    let views = match views {
        Ok(v) => v,
        Err(e) => {
            // Nothing was handed out: undo the pre_forward.
            let _ = on_unit(m, i, |u| u.post_forward(false));
            return Err(e);
        }
    };
    // SAFETY: params is NULL or valid for n writes (the caller's promise).
    unsafe { write_views(params, n, &views, "params") }
}

/// Views of the unit's full parameters in the view dtype (under mixed precision the
/// gathered parameters are `param_dtype` tensors already).
fn params_views(m: &mut ModelObj, i: usize) -> Res<Vec<DLTensor>> {
    let dt = view_dtype(m);
    let ps: Vec<Option<Tensor>> = params(m, i)?
        .into_iter()
        .map(|t| match dt {
            d if t.dtype() == d => Ok(Some(t)),
            d => Ok(Some(t.to_dtype(d)?)),
        })
        .collect::<Res<_>>()?;
    let views = describe_all(m, i, &ps)?;
    m.units[i].held = held(m, i, ps, ViewKind::Parameter);
    Ok(views)
}

/// The views `ts` (aligned with unit `i`'s parameters) as held by the host.
fn held(m: &ModelObj, i: usize, ts: Vec<Option<Tensor>>, kind: ViewKind) -> Vec<HeldView> {
    ts.into_iter()
        .zip(&m.units[i].params)
        .filter_map(|(t, p)| {
            Some(HeldView {
                kind,
                fqn: p.fqn.clone(),
                tensor: t?,
            })
        })
        .collect()
}

/// Refuses a host gradient `h` whose memory overlaps a view fsdp handed out and still
/// owns, of any unit: fsdp's own parameters added as their gradient (or a gradient view
/// added into itself) would train on the wrong numbers.
fn check_not_fsdp_memory(m: &ModelObj, h: &ExtTensor) -> Res {
    for v in m.units.iter().flat_map(|u| &u.held) {
        if !h.overlaps(&v.tensor)? {
            continue;
        }
        let (kind, array, fix) = match v.kind {
            ViewKind::Gradient => (
                "gradient",
                "grads",
                "a host that wrote into those views passes grads = NULL to fsdp_unit_post_backward",
            ),
            ViewKind::Parameter => (
                "parameter",
                "params",
                "parameter views are read-only inputs; pass the gradient in memory of your own",
            ),
        };
        return Err(Fail::arg(format!(
            "{}: the gradient's memory overlaps fsdp's own {kind} view of '{}' (the {array} of fsdp_unit_pre_backward); {fix}",
            h.what(),
            v.fqn,
        )));
    }
    Ok(())
}

/// After the unit's forward (`ok` 0: it failed; FSDP2 `FSDPParamGroup.post_forward`):
/// frees the gathered parameters when the strategy reshards after forward (FullShard;
/// not the root), without grad, or after a failure; the views of `fsdp_unit_pre_forward`
/// end here (on a CUDA device: with the work the host queued on `stream` before this
/// call, which fsdp waits for before reusing their memory). The root's with `ok` 0 ends
/// the whole forward: every unit's forward ends with it (one still between its hooks
/// included; it needs no post_forward) and every gathered parameter is freed, so no
/// backward is owed.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_USAGE` without pre_forward first, or on
/// the root while another unit is still between its pre_forward and post_forward (`ok`
/// 1); `FSDP_ERR_INVALID_ARGUMENT` (`stream` not NULL on the CPU).
#[no_mangle]
pub extern "C" fn fsdp_unit_post_forward(
    unit: fsdp_unit_t,
    ok: bool,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_unit_post_forward", || {
        with_unit(unit.id, "fsdp_unit_post_forward", |m, i| {
            on_stream(device(m), stream, || {
                on_unit(m, i, |u| u.post_forward(ok))?;
                m.units[i].held.clear();
                Ok(())
            })
        })
    })
}

/// Before the unit's backward (FSDP2 `FSDPParamGroup.pre_backward`): gathers its
/// parameters again if the forward freed them and points each trainable parameter's
/// gradient at a zeroed float32 flat-gradient buffer (under no_sync, at the gradient
/// accumulated so far). When not NULL, `params` gets the full parameters' views (as
/// [`fsdp_unit_pre_forward`]'s) and `grads` the gradient views (float32, the parameters'
/// shapes, on the model's device; a frozen parameter's entry has `data` NULL), both `n`
/// long, in declaration order, valid until `fsdp_unit_post_backward` (compact row-major,
/// as the parameter views). The host adds (`+=`) d loss / d param into `grads`, or passes
/// its own gradients to post_backward; on a CUDA device in work queued on `stream` after
/// this call (which is ordered after the zeroing). The root's pre_backward comes first in
/// a backward, before every other unit's.
///
/// Errors: as [`fsdp_unit_pre_forward`]; `FSDP_ERR_USAGE` twice without post_backward,
/// inside the root's forward, on another unit than the root outside the root's backward,
/// or after the root's `fsdp_unit_post_backward` without `fsdp_model_finish_backward` (a
/// second backward).
///
/// # Safety
/// `params` and `grads` are each NULL or valid for writes of `n` `DLTensor`s.
#[no_mangle]
pub unsafe extern "C" fn fsdp_unit_pre_backward(
    unit: fsdp_unit_t,
    params: *mut DLTensor,
    grads: *mut DLTensor,
    n: usize,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_unit_pre_backward", || {
        with_unit(unit.id, "fsdp_unit_pre_backward", |m, i| {
            on_stream(device(m), stream, || pre_backward(m, i, params, grads, n))
        })
    })
}

/// # Safety
/// As [`fsdp_unit_pre_backward`].
unsafe fn pre_backward(
    m: &mut ModelObj,
    i: usize,
    params: *mut DLTensor,
    grads: *mut DLTensor,
    n: usize,
) -> Res {
    check_len(params, n, m, i, "params")?;
    check_len(grads, n, m, i, "grads")?;
    on_unit(m, i, |u| u.pre_backward())?;
    let r = (|| {
        let pv = params_views(m, i)?;
        let gs = grad_tensors(m, i)?;
        let gv = describe_all(m, i, &gs)?;
        let gh = held(m, i, gs, ViewKind::Gradient);
        m.units[i].held.extend(gh);
        Ok((pv, gv))
    })();
    let (pv, gv) = match r {
        Ok(v) => v,
        Err(e) => {
            let _ = on_unit(m, i, |u| u.post_backward(false));
            m.units[i].held.clear();
            m.units[i].grad_f32.clear();
            return Err(e);
        }
    };
    // SAFETY: each NULL or valid for n writes (the caller's promise).
    unsafe {
        write_views(params, n, &pv, "params")?;
        write_views(grads, n, &gv, "grads")
    }
}

/// After the unit's backward (`ok` 0: it failed; FSDP2 `FSDPParamGroup.post_backward`):
/// when `grads` is not NULL, adds `grads[0..n]` (each the shape of its parameter, in
/// declaration order, on the model's device; float32, or under mixed precision also its
/// 16-bit `param_dtype`, widened to float32; a frozen parameter's entry is ignored; this
/// rank's gradient of its own loss: fsdp averages over the ranks) into the unit's flat
/// gradient, then frees the gathered parameters and issues the gradient reduction in
/// `reduce_dtype` (under no_sync, keeps the gradient instead). The root's post_backward
/// comes last and ends the backward: `fsdp_model_finish_backward` is next. On a CUDA
/// device fsdp reads the gradients (and the gradient views the host wrote) after the
/// work queued on `stream` before this call, and the host's later work on `stream` may
/// reuse that memory. Every gradient is checked before any is added: on a size, dtype or
/// device error nothing changed and the unit is still in its backward (call again).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_USAGE` without pre_backward first, or on
/// the root while another unit is still in its backward (`ok` 1);
/// `FSDP_ERR_SHAPE_MISMATCH`, `FSDP_ERR_DTYPE_MISMATCH`, `FSDP_ERR_DEVICE_MISMATCH`
/// naming the parameter; `FSDP_ERR_INVALID_ARGUMENT` for a gradient whose memory overlaps
/// a view fsdp handed out (a parameter view, or a gradient view: the host that wrote into
/// those passes `grads` NULL), or `stream` not NULL on the CPU; `FSDP_ERR_OUT_OF_MEMORY`.
///
/// # Safety
/// `grads` is NULL or valid for reads of `n` `DLTensor`s, each describing memory valid for
/// reads (in stream order on a CUDA device).
#[no_mangle]
pub unsafe extern "C" fn fsdp_unit_post_backward(
    unit: fsdp_unit_t,
    grads: *const DLTensor,
    n: usize,
    ok: bool,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_unit_post_backward", || {
        with_unit(unit.id, "fsdp_unit_post_backward", |m, i| {
            on_stream(device(m), stream, || {
                if !grads.is_null() {
                    // SAFETY: the caller's promise on grads.
                    unsafe { add_grads(m, i, grads, n) }?;
                }
                let folded = if ok { fold_f32_grads(m, i) } else { Ok(()) };
                m.units[i].grad_f32.clear();
                on_unit(m, i, |u| u.post_backward(ok && folded.is_ok()))?;
                folded?;
                m.units[i].held.clear();
                Ok(())
            })
        })
    })
}

/// # Safety
/// As [`fsdp_unit_post_backward`].
unsafe fn add_grads(m: &mut ModelObj, i: usize, grads: *const DLTensor, n: usize) -> Res {
    check_len(grads, n, m, i, "grads")?;
    let views = match grad_tensors(m, i) {
        Ok(v) => v,
        // Not in its backward: post_backward's own error says so.
        Err(f) if f.status == FSDP_ERR_USAGE => {
            on_unit(m, i, |u| u.post_backward(true))?;
            return Err(f);
        }
        Err(f) => return Err(f),
    };
    let dev = device(m);
    let accepted = match view_dtype(m) {
        DType::F32 => vec![DType::F32],
        d => vec![DType::F32, d],
    };
    let mut checked = Vec::new();
    for (k, (p, view)) in m.units[i].params.iter().zip(&views).enumerate() {
        let Some(view) = view else { continue };
        let what = format!("grads[{k}] ('{}')", p.fqn);
        // SAFETY: grads is valid for n reads and k < n (checked against n above).
        let h = unsafe { ExtTensor::check(grads.add(k), &what) }?;
        h.expect_device(dev, "the model computes")?;
        h.expect_dtype_in(&accepted)?;
        h.expect_shape(view.shape())?;
        check_not_fsdp_memory(m, &h)?;
        checked.push((h, view.clone()));
    }
    for (h, view) in checked {
        // SAFETY: the caller promises each gradient's memory is readable, and none
        // overlaps its view (`check_not_fsdp_memory`: every gradient view is held).
        unsafe { h.add_into(&view) }?;
    }
    Ok(())
}

/// Once per backward, after the root's `fsdp_unit_post_backward` (also after a failed
/// backward, whose post hooks got `ok` 0): waits for every unit's gradient reduction and
/// accumulates it into the sharded gradients the optimizer steps on. It cannot be
/// skipped: until it runs, `fsdp_optimizer_step`, `fsdp_model_zero_grad`,
/// `fsdp_model_clip_grad_norm` and every unit's `fsdp_unit_pre_forward` and
/// `fsdp_unit_pre_backward` return `FSDP_ERR_USAGE` naming it (the backward's gradients
/// would be missing from the step and added into the next one).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_USAGE` without a backward, or before the
/// root's `fsdp_unit_post_backward`; the first reduction's error
/// (`FSDP_ERR_COLLECTIVE_MISMATCH` when ranks disagree on no_sync, `FSDP_ERR_TIMEOUT`,
/// `FSDP_ERR_PEER_FAILED`).
#[no_mangle]
pub extern "C" fn fsdp_model_finish_backward(
    model: fsdp_model_t,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_model_finish_backward", || {
        with_model(model.id, "model", "fsdp_model_finish_backward", |m| {
            on_stream(device(m), stream, || Ok(m.fsdp.finish_backward()?))
        })
    })
}

/// `no_sync` on (`no_sync` 1) or off (0) until called again: backwards with it on keep
/// each unit's unsharded gradient locally (no reduction); the first backward after it is
/// turned off reduces the accumulated sum. Every rank does the same. A step while such
/// gradients are kept is refused (it would skip them); `fsdp_model_zero_grad` drops them.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn fsdp_model_set_no_sync(model: fsdp_model_t, no_sync: bool) -> fsdp_status {
    guard("fsdp_model_set_no_sync", || {
        with_model(model.id, "model", "fsdp_model_set_no_sync", |m| {
            m.fsdp.set_requires_gradient_sync(!no_sync);
            Ok(())
        })
    })
}

/// `clip_grad_norm_(max_norm, norm_type)` over every unit and rank (a collective): scales
/// the gradient shards so their total `norm_type`-norm (a finite p >= 1, or INFINITY) is
/// at most `max_norm`; the norm before clipping, the same on every rank, in `*total_norm`
/// (may be NULL).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for a bad `max_norm` or
/// `norm_type`; `FSDP_ERR_USAGE` inside a forward or backward, or before
/// `fsdp_model_finish_backward`; collective errors.
///
/// # Safety
/// `total_norm` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_model_clip_grad_norm(
    model: fsdp_model_t,
    max_norm: f32,
    norm_type: f32,
    total_norm: *mut f32,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_model_clip_grad_norm", || {
        let t = with_model(model.id, "model", "fsdp_model_clip_grad_norm", |m| {
            on_stream(device(m), stream, || {
                Ok(m.fsdp.clip_grad_norm_(max_norm, norm_type)?)
            })
        })?;
        if !total_norm.is_null() {
            // SAFETY: non-null, valid for a write (the caller's promise).
            unsafe { write_out(total_norm, "total_norm", t) }?;
        }
        Ok(())
    })
}

/// Drops every gradient shard and every gradient kept unreduced under no_sync
/// (`zero_grad(set_to_none=True)`); once per optimizer step on every rank (it also ends
/// the step for fsdp's collective checks). Between passes only: inside a forward or a
/// backward, or after the root's `fsdp_unit_post_backward` without
/// `fsdp_model_finish_backward`, it is refused (the backward's reductions still to be
/// added would survive it).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_USAGE` naming what was expected.
#[no_mangle]
pub extern "C" fn fsdp_model_zero_grad(model: fsdp_model_t) -> fsdp_status {
    guard("fsdp_model_zero_grad", || {
        with_model(model.id, "model", "fsdp_model_zero_grad", |m| {
            m.fsdp.ready_for_zero_grad()?;
            m.fsdp.zero_grad();
            Ok(())
        })
    })
}
