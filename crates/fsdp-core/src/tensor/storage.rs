//! Reference-counted buffers that tensors view into.
//!
//! A [`Storage`] is one allocation on one device. Many tensors can view it (a FlatParameter's
//! unsharded buffer is viewed by every original parameter of the unit). Access goes through a
//! read/write lock: reads are shared, writes exclusive, so two views never race.

use crate::device::Device;
use crate::dtype::DType;
use half::{bf16, f16};
use std::any::Any;
use std::sync::Arc;

/// Memory a backend allocated on a device, as the tensor layer sees it: an ordinal and a
/// size. The tensor layer imports no backend, so a [`Buffer::Cuda`] holds its allocation
/// behind this trait; the CUDA backend's `DeviceBuffer` implements it and gets itself back
/// through [`DeviceAllocation::into_any`].
pub trait DeviceAllocation: std::fmt::Debug + Send + Sync + 'static {
    /// The device ordinal (`cuda:i`).
    fn ordinal(&self) -> usize;
    /// Size in bytes.
    fn len_bytes(&self) -> usize;
    /// The allocation as `Any`, for the backend that made it to downcast.
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

/// Page-locked ("pinned") host memory a backend allocated (CUDA's `cuMemHostAlloc`):
/// ordinary host memory to the CPU ops, which the device can copy to and from
/// asynchronously (PyTorch's `Tensor.pin_memory()` / `is_pinned()`). The backend's
/// `PinnedBuffer` implements it and frees the memory when the last view drops.
///
/// # Safety
/// `as_ptr` must point to `len_bytes` bytes, aligned to at least 8 bytes, valid for
/// reads and writes for the allocation's whole life and owned by it alone.
pub unsafe trait HostAllocation: std::fmt::Debug + Send + Sync + 'static {
    /// The first byte.
    fn as_ptr(&self) -> *mut u8;
    /// Size in bytes.
    fn len_bytes(&self) -> usize;
    /// The allocation as `Any`, for the backend that made it to downcast.
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

/// The typed contents of a storage.
#[derive(Debug)]
pub enum Buffer {
    /// `DType::F32` values (`torch.float32`), 4 bytes each.
    F32(Vec<f32>),
    /// `DType::BF16` values (`torch.bfloat16`), 2 bytes each.
    BF16(Vec<bf16>),
    /// `DType::F16` values (`torch.float16`), 2 bytes each.
    F16(Vec<f16>),
    /// `DType::I32` values (`torch.int32`), 4 bytes each, e.g. token ids.
    I32(Vec<i32>),
    /// `DType::F64` values (`torch.float64`), 8 bytes each.
    F64(Vec<f64>),
    /// `DType::I64` values (`torch.int64`), 8 bytes each, e.g. `num_batches_tracked`.
    I64(Vec<i64>),
    /// Device memory (`Device::Cuda`): a block of the CUDA backend's caching allocator
    /// holding `len` elements of `dtype`. Its contents are reached through the backend's
    /// `DeviceTensor` views and ops, never as host slices. Only a build with the `cuda`
    /// feature makes one.
    Cuda {
        /// The allocation, shared with `DeviceTensor` views of it.
        buf: Arc<dyn DeviceAllocation>,
        /// Element type.
        dtype: DType,
        /// Element count.
        len: usize,
    },
    /// Page-locked host memory (`Device::Cpu`): `len` elements of `dtype` in a
    /// [`HostAllocation`] (CUDA's `cuMemHostAlloc`). The CPU reads and writes it as any
    /// host buffer; the CUDA backend copies it to and from the device asynchronously.
    /// Only a build with the `cuda` feature makes one.
    Pinned {
        /// The allocation.
        buf: Arc<dyn HostAllocation>,
        /// Element type.
        dtype: DType,
        /// Element count.
        len: usize,
    },
    /// Shapes only, no memory (`Device::Meta`): the element count and dtype it stands for,
    /// and, for a parameter built on the meta device, how to compute its values.
    Meta {
        /// Element count the buffer stands for.
        len: usize,
        /// Element type the buffer stands for.
        dtype: DType,
        /// The initializer of element `i` (deferred init), if known.
        init: Option<crate::init::ParamInit>,
    },
}

impl Buffer {
    /// Zero-filled CPU buffer of `len` elements (from the [buffer pool](super::pool) when
    /// it holds one of that dtype and length). Aborts when the memory is not there, as
    /// `vec!` does; [`Buffer::try_zeros`] returns the error.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        super::pool::take(dtype, len, true)
    }

    /// [`Buffer::zeros`], or [`Error::OutOfMemory`](crate::Error::OutOfMemory) when the
    /// allocator cannot serve it.
    pub fn try_zeros(dtype: DType, len: usize) -> crate::Result<Buffer> {
        super::pool::try_take(dtype, len, true)
    }

    /// A newly allocated zero-filled CPU buffer (what the pool falls back on).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) when the allocator cannot serve it.
    pub(crate) fn try_new_zeroed(dtype: DType, len: usize) -> crate::Result<Buffer> {
        use super::alloc::zeroed_vec;
        Ok(match dtype {
            DType::F32 => Buffer::F32(zeroed_vec(len)?),
            DType::BF16 => Buffer::BF16(zeroed_vec(len)?),
            DType::F16 => Buffer::F16(zeroed_vec(len)?),
            DType::I32 => Buffer::I32(zeroed_vec(len)?),
            DType::F64 => Buffer::F64(zeroed_vec(len)?),
            DType::I64 => Buffer::I64(zeroed_vec(len)?),
        })
    }

    /// Whether this is host memory the pool can keep (a `Vec` of one of the host dtypes).
    pub(crate) fn is_host_vec(&self) -> bool {
        matches!(
            self,
            Buffer::F32(_)
                | Buffer::BF16(_)
                | Buffer::F16(_)
                | Buffer::I32(_)
                | Buffer::F64(_)
                | Buffer::I64(_)
        )
    }

    /// Sets every element of a host buffer to zero (other buffers are left alone).
    pub(crate) fn fill_zero(&mut self) {
        match self {
            Buffer::F32(v) => v.fill(0.0),
            Buffer::BF16(v) => v.fill(bf16::ZERO),
            Buffer::F16(v) => v.fill(f16::ZERO),
            Buffer::I32(v) => v.fill(0),
            Buffer::F64(v) => v.fill(0.0),
            Buffer::I64(v) => v.fill(0),
            Buffer::Cuda { .. } | Buffer::Pinned { .. } | Buffer::Meta { .. } => {}
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::BF16(v) => v.len(),
            Buffer::F16(v) => v.len(),
            Buffer::I32(v) => v.len(),
            Buffer::F64(v) => v.len(),
            Buffer::I64(v) => v.len(),
            Buffer::Cuda { len, .. } | Buffer::Pinned { len, .. } => *len,
            Buffer::Meta { len, .. } => *len,
        }
    }

    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::BF16(_) => DType::BF16,
            Buffer::F16(_) => DType::F16,
            Buffer::I32(_) => DType::I32,
            Buffer::F64(_) => DType::F64,
            Buffer::I64(_) => DType::I64,
            Buffer::Cuda { dtype, .. } | Buffer::Pinned { dtype, .. } => *dtype,
            Buffer::Meta { dtype, .. } => *dtype,
        }
    }
}

/// One allocation: a buffer behind a lock, on a device. A CPU buffer goes back to the
/// [buffer pool](super::pool) when the last view of it drops.
#[derive(Debug)]
pub struct Storage {
    pub(crate) buf: parking_lot::RwLock<Buffer>,
    pub(crate) device: Device,
    /// The pool's owner of a host buffer: the thread whose buckets it goes back to.
    owner: super::pool::Owner,
}

impl Storage {
    /// Wraps a buffer; the device follows from it (`Meta`, `Cuda(ordinal)`, else `Cpu`).
    /// A host buffer counts as live in the [buffer pool](super::pool)'s figures until the
    /// storage drops.
    pub fn new(buf: Buffer) -> Storage {
        let owner = super::pool::went_live(&buf);
        Self::counted(buf, owner)
    }

    /// [`Storage::new`] for a buffer the pool already counts as live, as `owner`'s.
    pub(crate) fn counted(buf: Buffer, owner: super::pool::Owner) -> Storage {
        let device = match &buf {
            Buffer::Meta { .. } => Device::Meta,
            Buffer::Cuda { buf, .. } => Device::Cuda(buf.ordinal()),
            _ => Device::Cpu,
        };
        Storage {
            buf: parking_lot::RwLock::new(buf),
            device,
            owner,
        }
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        let b = self.buf.get_mut();
        if b.is_host_vec() {
            super::pool::give_back(std::mem::replace(b, Buffer::F32(Vec::new())), self.owner);
        }
    }
}
