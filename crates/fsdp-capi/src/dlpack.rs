//! DLPack tensors at the boundary (the `DLTensor` of DLPack v0.8 and v1.0, same layout):
//! checking a host's `DLTensor`, copying it into and out of fsdp tensors, and describing
//! fsdp's own buffers (full parameters, flat-gradient views) as `DLTensor`s that point
//! into them, without a copy. Host memory is `kDLCPU` (or `kDLCUDAHost`, pinned host
//! memory); device memory is `kDLCUDA` with its `device_id`, copied on fsdp's stream in
//! the order `device.rs` sets up with the host's stream.
//!
//! The C declarations are written in `cbindgen.toml` as DLPack's `dlpack.h` has them (the
//! `DLDeviceType` and `DLDataTypeCode` enums included), inside `#ifndef DLPACK_DLPACK_H_`
//! so a host that includes `dlpack.h` first keeps DLPack's own; `tests/capi/header.rs`
//! checks that their layout equals these Rust structs. Enum-typed fields are plain
//! integers here: a value C sends that no enum variant has is an error, not undefined
//! behaviour.

use super::{
    Fail, Res, FSDP_ERR_DEVICE_MISMATCH, FSDP_ERR_DTYPE_MISMATCH, FSDP_ERR_SHAPE_MISMATCH,
    FSDP_ERR_UNSUPPORTED,
};
use fsdp::backend::Device;
use fsdp::tensor::alloc::vec_from_slice;
use fsdp::tensor::{DType, Element, Tensor};
use std::ffi::c_void;

/// `DLDevice`: where a tensor's memory is (`device_type` a `DLDeviceType`: `kDLCPU` = 1,
/// `kDLCUDA` = 2, ...) and which device of that type.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDevice {
    /// `DLDeviceType`.
    pub device_type: i32,
    /// Device ordinal (0 for the CPU).
    pub device_id: i32,
}

/// `DLDataType`: `code` a `DLDataTypeCode` (`kDLInt` = 0, `kDLFloat` = 2, `kDLBfloat` =
/// 4), `bits` per lane, `lanes` (1 for scalars).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDataType {
    /// `DLDataTypeCode`.
    pub code: u8,
    /// Bits per element.
    pub bits: u8,
    /// Vector lanes; 1.
    pub lanes: u16,
}

/// `DLTensor`: `ndim` dimensions of `shape` (and `strides` in elements, or NULL for
/// compact row-major) starting `byte_offset` bytes after `data`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLTensor {
    /// Base pointer of the memory.
    pub data: *mut c_void,
    /// Where the memory is.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` sizes.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or NULL (compact row-major).
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
const KDL_CUDA_MANAGED: i32 = 13;
const KDL_INT: u8 = 0;
const KDL_FLOAT: u8 = 2;
const KDL_BFLOAT: u8 = 4;
/// Dimensions beyond this are refused (a garbage `ndim` is not a reason to allocate).
const MAX_NDIM: i32 = 64;

/// The DLPack dtype of `d`.
pub(crate) fn dl_dtype(d: DType) -> DLDataType {
    let (code, bits) = match d {
        DType::F32 => (KDL_FLOAT, 32),
        DType::F16 => (KDL_FLOAT, 16),
        DType::BF16 => (KDL_BFLOAT, 16),
        DType::I32 => (KDL_INT, 32),
        DType::F64 => (KDL_FLOAT, 64),
        DType::I64 => (KDL_INT, 64),
    };
    DLDataType {
        code,
        bits,
        lanes: 1,
    }
}

/// The device a `DLDevice` names for a model (`fsdp_config.device`): `{kDLCPU, 0}` or
/// `{kDLCUDA, i}`.
pub(crate) fn config_device(d: DLDevice, what: &str) -> Res<Device> {
    match (d.device_type, d.device_id) {
        (KDL_CPU, 0) => Ok(Device::Cpu),
        (KDL_CPU, i) => Err(Fail::arg(format!(
            "{what} {{kDLCPU, {i}}}: the CPU's device_id is 0"
        ))),
        (KDL_CUDA, i) if i >= 0 => Ok(Device::Cuda(i as usize)),
        (KDL_CUDA, i) => Err(Fail::arg(format!(
            "{what} {{kDLCUDA, {i}}}: device_id is negative"
        ))),
        (t, i) => Err(Fail::arg(format!(
            "{what} {{{t}, {i}}}: device_type is neither kDLCPU (1) nor kDLCUDA (2) (fsdp_config_default fills {{kDLCPU, 0}})"
        ))),
    }
}

fn dtype_of(t: DLDataType, what: &str) -> Res<DType> {
    match (t.code, t.bits, t.lanes) {
        (KDL_FLOAT, 32, 1) => Ok(DType::F32),
        (KDL_FLOAT, 16, 1) => Ok(DType::F16),
        (KDL_BFLOAT, 16, 1) => Ok(DType::BF16),
        (KDL_INT, 32, 1) => Ok(DType::I32),
        (c, b, l) => Err(Fail::new(
            FSDP_ERR_DTYPE_MISMATCH,
            format!("{what}: dtype {{code {c}, bits {b}, lanes {l}}} is not one fsdp takes (float32, float16, bfloat16, int32; lanes 1)"),
        )),
    }
}

/// A host's tensor described by a checked `DLTensor`: where its first element is (host
/// memory, or device memory of `cuda:i`), its dtype and shape (compact row-major).
pub(crate) struct ExtTensor {
    ptr: *mut u8,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    /// `Cpu` for `kDLCPU` and `kDLCUDAHost` (pinned host memory), `Cuda(i)` for `kDLCUDA`.
    pub(crate) device: Device,
    what: String,
}

impl ExtTensor {
    /// Checks `*t`: host memory (`kDLCPU`, `kDLCUDAHost`) or device memory (`kDLCUDA`,
    /// `device_id` >= 0), a dtype fsdp has, compact row-major, its first element aligned
    /// and non-NULL unless it is empty. Which device a call takes is checked by the call
    /// ([`ExtTensor::expect_device`]).
    ///
    /// # Safety
    /// `t` is NULL or points to a `DLTensor` whose `shape` and `strides` (when non-NULL)
    /// hold `ndim` values. Its `data` is not dereferenced here.
    pub(crate) unsafe fn check(t: *const DLTensor, what: &str) -> Res<ExtTensor> {
        if t.is_null() {
            return Err(Fail::arg(format!("{what}: the DLTensor pointer is NULL")));
        }
        // SAFETY: non-null, and the caller promises it points to a DLTensor.
        let t = unsafe { &*t };
        let device = match (t.device.device_type, t.device.device_id) {
            (KDL_CPU | KDL_CUDA_HOST, _) => Device::Cpu,
            (KDL_CUDA, i) if i >= 0 => Device::Cuda(i as usize),
            (KDL_CUDA, i) => {
                return Err(Fail::arg(format!(
                    "{what}: device_id {i} of a kDLCUDA tensor is negative"
                )))
            }
            (KDL_CUDA_MANAGED, _) => {
                return Err(Fail::new(
                    FSDP_ERR_UNSUPPORTED,
                    format!("{what}: managed memory (kDLCUDAManaged) is not taken: describe it as kDLCUDA (device memory) or kDLCPU"),
                ))
            }
            (d, _) => {
                return Err(Fail::new(
                    FSDP_ERR_UNSUPPORTED,
                    format!("{what}: device type {d} is neither host memory (kDLCPU = 1, kDLCUDAHost = 3) nor a CUDA device (kDLCUDA = 2)"),
                ))
            }
        };
        let dtype = dtype_of(t.dtype, what)?;
        if !(0..=MAX_NDIM).contains(&t.ndim) {
            return Err(Fail::arg(format!(
                "{what}: ndim {} is not in 0..={MAX_NDIM}",
                t.ndim
            )));
        }
        let ndim = t.ndim as usize;
        if ndim > 0 && t.shape.is_null() {
            return Err(Fail::arg(format!("{what}: shape is NULL with ndim {ndim}")));
        }
        let mut shape = Vec::with_capacity(ndim);
        for i in 0..ndim {
            // SAFETY: shape holds ndim values (the caller's promise), checked non-null.
            let d = unsafe { *t.shape.add(i) };
            if d < 0 {
                return Err(Fail::arg(format!("{what}: shape[{i}] = {d} is negative")));
            }
            shape.push(d as usize);
        }
        let (numel, _) = fsdp::tensor::alloc::checked_size(&shape, dtype)
            .map_err(|e| Fail::arg(format!("{what}: {e}")))?;
        if !t.strides.is_null() {
            let mut expect = 1i64;
            for i in (0..ndim).rev() {
                // SAFETY: strides holds ndim values when non-null (the caller's promise).
                let s = unsafe { *t.strides.add(i) };
                if s != expect && shape[i] != 1 {
                    return Err(Fail::arg(format!(
                        "{what}: strides are not compact row-major (dim {i}: stride {s}, expected {expect}); pass a contiguous tensor or strides NULL"
                    )));
                }
                expect = expect.saturating_mul(shape[i] as i64);
            }
        }
        let ptr = (t.data as *mut u8).wrapping_add(t.byte_offset as usize);
        if numel > 0 {
            if t.data.is_null() {
                return Err(Fail::arg(format!(
                    "{what}: data is NULL for a tensor of {numel} elements"
                )));
            }
            if (ptr as usize) % dtype.size_in_bytes() != 0 {
                return Err(Fail::arg(format!(
                    "{what}: data + byte_offset ({ptr:p}) is not aligned to its {}-byte elements",
                    dtype.size_in_bytes()
                )));
            }
        }
        Ok(ExtTensor {
            ptr,
            dtype,
            shape,
            device,
            what: what.to_string(),
        })
    }

    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }

    /// Refuses any dtype but `want`.
    pub(crate) fn expect_dtype(&self, want: DType) -> Res {
        self.expect_dtype_in(&[want])
    }

    /// Refuses a dtype not in `want`.
    pub(crate) fn expect_dtype_in(&self, want: &[DType]) -> Res {
        if !want.contains(&self.dtype) {
            let names: Vec<String> = want.iter().map(|d| d.to_string()).collect();
            return Err(Fail::new(
                FSDP_ERR_DTYPE_MISMATCH,
                format!(
                    "{}: dtype {}, expected {}",
                    self.what,
                    self.dtype,
                    names.join(" or ")
                ),
            ));
        }
        Ok(())
    }

    /// Refuses any shape but `want`.
    pub(crate) fn expect_shape(&self, want: &[usize]) -> Res {
        if self.shape != want {
            return Err(Fail::new(
                FSDP_ERR_SHAPE_MISMATCH,
                format!("{}: shape {:?}, expected {want:?}", self.what, self.shape),
            ));
        }
        Ok(())
    }

    /// Refuses memory of another device than `want` (`FSDP_ERR_DEVICE_MISMATCH` saying
    /// which device the tensor is on and which one the call works on: `of`, e.g. "the
    /// model computes").
    pub(crate) fn expect_device(&self, want: Device, of: &str) -> Res {
        if self.device == want {
            return Ok(());
        }
        let is = match self.device {
            Device::Cuda(i) => format!("a CUDA tensor (kDLCUDA, device_id {i})"),
            _ => "a host tensor (kDLCPU)".to_string(),
        };
        let fix = match want {
            Device::Cuda(i) => format!("pass device memory of cuda:{i} (kDLCUDA, device_id {i})"),
            _ => "pass host memory (kDLCPU), or build the model with fsdp_config.device kDLCUDA"
                .to_string(),
        };
        let on = match want {
            Device::Cuda(i) => format!("cuda:{i}"),
            _ => "the CPU".to_string(),
        };
        Err(Fail::new(
            FSDP_ERR_DEVICE_MISMATCH,
            format!("{}: {is}, but {of} on {on}: {fix}", self.what),
        ))
    }

    /// The elements as a slice (host memory only).
    ///
    /// # Safety
    /// The memory the checked `DLTensor` describes is valid for reads for `'a` and not
    /// written meanwhile; `T` is its dtype.
    unsafe fn slice<'a, T: Element>(&self) -> &'a [T] {
        if self.numel() == 0 {
            return &[];
        }
        // SAFETY: non-null, aligned and in bounds were checked in `check`; validity for
        // reads is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.numel()) }
    }

    /// A copy of the elements as an fsdp tensor of the same shape and dtype, on the same
    /// device (device memory: a copy queued on fsdp's stream, ordered after the host's by
    /// [`super::device::on_stream`]).
    ///
    /// # Safety
    /// As [`ExtTensor::slice`], for the duration of the call (in stream order for device
    /// memory).
    pub(crate) unsafe fn to_tensor(&self) -> Res<Tensor> {
        if let Device::Cuda(i) = self.device {
            // SAFETY: checked device memory of cuda:i (the caller's promise).
            return unsafe {
                super::device::copy_in(self.ptr as u64, self.dtype, &self.shape, i, &self.what)
            };
        }
        fn copy<T: Element>(s: &[T], shape: &[usize], what: &str) -> fsdp::Result<Tensor> {
            let v =
                vec_from_slice(s).map_err(|e| e.allocating(|| format!("the copy of {what}")))?;
            Tensor::from_vec(v, shape)
        }
        let (shape, what) = (&self.shape, &self.what);
        // SAFETY (this and each arm below): the dtype matched, readability is the
        // caller's promise.
        let t = match self.dtype {
            // SAFETY: as above.
            DType::F32 => copy(unsafe { self.slice::<f32>() }, shape, what),
            // SAFETY: as above.
            DType::BF16 => copy(unsafe { self.slice::<half::bf16>() }, shape, what),
            // SAFETY: as above.
            DType::F16 => copy(unsafe { self.slice::<half::f16>() }, shape, what),
            // SAFETY: as above.
            DType::I32 => copy(unsafe { self.slice::<i32>() }, shape, what),
            // SAFETY: as above.
            DType::F64 => copy(unsafe { self.slice::<f64>() }, shape, what),
            // SAFETY: as above.
            DType::I64 => copy(unsafe { self.slice::<i64>() }, shape, what),
        };
        Ok(t?)
    }

    /// Copies `src` (same dtype and element count, on this tensor's device) into the
    /// host's memory.
    ///
    /// # Safety
    /// The memory is valid for writes for the duration of the call (in stream order for
    /// device memory) and nothing else accesses it meanwhile.
    pub(crate) unsafe fn write_from(&self, src: &Tensor) -> Res {
        if src.dtype() != self.dtype || src.numel() != self.numel() || src.device() != self.device {
            return Err(Fail::arg(format!(
                "{}: internal: result of {} {} elements on {} for {} {} elements on {}",
                self.what,
                src.dtype(),
                src.numel(),
                src.device(),
                self.dtype,
                self.numel(),
                self.device
            )));
        }
        if self.numel() == 0 {
            return Ok(());
        }
        if self.device.is_cuda() {
            // SAFETY: device memory of src's device, writable (the caller's promise); src
            // is fsdp's own allocation, so they do not overlap.
            return unsafe { super::device::copy_out(self.ptr as u64, src, &self.what) };
        }
        let n = src.nbytes();
        let from = host_ptr(src)? as *const u8;
        // SAFETY: `self.ptr` is valid for n bytes of writes (the caller's promise; the
        // size matches the checked shape and dtype); `from` is n bytes of fsdp's own
        // memory (`src`, a host tensor of this dtype and element count, alive for the
        // call), so the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(from, self.ptr, n) };
        Ok(())
    }

    /// The argument this tensor was passed as (`"grads[0] ('1.weight')"`).
    pub(crate) fn what(&self) -> &str {
        &self.what
    }

    /// Whether this tensor's memory overlaps fsdp's tensor `t` (of the same device).
    pub(crate) fn overlaps(&self, t: &Tensor) -> Res<bool> {
        if self.numel() == 0 || t.numel() == 0 || t.device() != self.device {
            return Ok(false);
        }
        let lo = match t.device() {
            Device::Cuda(_) => super::device::device_ptr(t)? as usize,
            _ => host_ptr(t)? as usize,
        };
        let hi = lo + t.nbytes();
        let (slo, shi) = (self.ptr as usize, self.ptr as usize + self.nbytes());
        Ok(slo < hi && lo < shi)
    }

    /// `dst += self` elementwise: `dst` an f32 tensor of the same element count on this
    /// tensor's device, `self` f32, bf16 or f16 (widened to f32 first). The caller has
    /// refused memory that overlaps `dst` (or any view fsdp handed out).
    ///
    /// # Safety
    /// As [`ExtTensor::to_tensor`]; and this tensor's memory does not overlap `dst`
    /// ([`ExtTensor::overlaps`] is false).
    pub(crate) unsafe fn add_into(&self, dst: &Tensor) -> Res {
        if self.device.is_cuda() || self.dtype != DType::F32 {
            // SAFETY: forwarded.
            let t = unsafe { self.to_tensor() }?;
            let t = match t.dtype() {
                DType::F32 => t,
                _ => t.to_dtype(DType::F32)?,
            };
            return Ok(fsdp::ops::add_(dst, &t)?);
        }
        let mut d = dst.f32_mut()?;
        // SAFETY: the dtype is f32, readability is the caller's promise, and the memory
        // does not overlap `d` (the caller's promise).
        let s = unsafe { self.slice::<f32>() };
        for (a, b) in d.iter_mut().zip(s) {
            *a += *b;
        }
        Ok(())
    }
}

/// Address of a host tensor's first element. It stays valid while any clone of `t` (which
/// keeps its storage alive) exists: storages never reallocate.
pub(crate) fn host_ptr(t: &Tensor) -> Res<*mut c_void> {
    Ok(match t.dtype() {
        DType::F32 => t.data_mut::<f32>()?.as_mut_ptr() as *mut c_void,
        DType::BF16 => t.data_mut::<half::bf16>()?.as_mut_ptr() as *mut c_void,
        DType::F16 => t.data_mut::<half::f16>()?.as_mut_ptr() as *mut c_void,
        DType::I32 => t.data_mut::<i32>()?.as_mut_ptr() as *mut c_void,
        DType::F64 => t.data_mut::<f64>()?.as_mut_ptr() as *mut c_void,
        DType::I64 => t.data_mut::<i64>()?.as_mut_ptr() as *mut c_void,
    })
}

/// A `DLTensor` describing fsdp's tensor `t` in place (host memory, or device memory of
/// `cuda:i` as `kDLCUDA`, `device_id` i); `shape` (the same dimensions as `t`'s) must
/// outlive every use the host makes of it.
pub(crate) fn describe(t: &Tensor, shape: &[i64]) -> Res<DLTensor> {
    if shape.len() != t.shape().len() || shape.iter().zip(t.shape()).any(|(&a, &b)| a as usize != b)
    {
        return Err(Fail::arg(format!(
            "internal: shape {shape:?} for a tensor of shape {:?}",
            t.shape()
        )));
    }
    let (data, device) = match t.device() {
        Device::Cuda(i) => (
            super::device::device_ptr(t)? as *mut c_void,
            DLDevice {
                device_type: KDL_CUDA,
                device_id: i as i32,
            },
        ),
        _ => (
            host_ptr(t)?,
            DLDevice {
                device_type: KDL_CPU,
                device_id: 0,
            },
        ),
    };
    Ok(DLTensor {
        data,
        device,
        ndim: shape.len() as i32,
        dtype: dl_dtype(t.dtype()),
        shape: shape.as_ptr() as *mut i64,
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    })
}

/// An all-zero `DLTensor` (data NULL): what a frozen parameter's gradient slot holds.
pub(crate) fn empty_tensor() -> DLTensor {
    DLTensor {
        data: std::ptr::null_mut(),
        device: DLDevice {
            device_type: KDL_CPU,
            device_id: 0,
        },
        ndim: 0,
        dtype: dl_dtype(DType::F32),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// Writes `views` into the host's array `out` of `n` `DLTensor`s, argument `what`.
///
/// # Safety
/// `out` is NULL or valid for writes of `n` `DLTensor`s.
pub(crate) unsafe fn write_views(
    out: *mut DLTensor,
    n: usize,
    views: &[DLTensor],
    what: &str,
) -> Res {
    if out.is_null() {
        return Ok(());
    }
    if n != views.len() {
        return Err(Fail::new(
            FSDP_ERR_SHAPE_MISMATCH,
            format!(
                "{what}: the array holds {n} DLTensors but the unit has {} parameters (fsdp_unit_num_params)",
                views.len()
            ),
        ));
    }
    for (i, v) in views.iter().enumerate() {
        // SAFETY: out is valid for n writes (the caller's promise) and i < n.
        unsafe { out.add(i).write(*v) };
    }
    Ok(())
}
