//! Tensors: a dtype, a shape, and a contiguous window (`offset .. offset + numel`) into a
//! shared [`Storage`].
//!
//! Views share storage: [`Tensor::view`] is how a parameter becomes a window into its
//! FlatParameter's unsharded buffer (FSDP1 `FlatParamHandle._get_unflat_views`), with no
//! copy. Tensors are contiguous row-major; ops that need a transpose take it as a flag.
//!
//! This layer holds storage (host vectors, pinned host memory behind [`HostAllocation`],
//! a device allocation behind [`DeviceAllocation`], or nothing on the meta device), views
//! and host access, and imports no backend. The methods that move, copy, cast or fill a
//! tensor by its device (`to_device`, `copy_from`, `to_dtype`, `zeros_on`, `zero_`,
//! `to_vec_f32`, `pinned_zeros`) are defined one layer up, in `backend/tensor.rs`, where
//! the backends are.

pub mod alloc;
mod dtype;
pub mod pool;
mod storage;

pub use crate::device::Device;
pub use crate::dtype::DType;
pub use dtype::Element;
pub use pool::{empty_cache, memory_stats, reset_peak_memory_stats, HostMemoryStats, PoolUser};
pub use storage::{Buffer, DeviceAllocation, HostAllocation, Storage};

use crate::error::{Error, Result};
use parking_lot::{
    MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLockReadGuard, RwLockWriteGuard,
};
use std::sync::Arc;

/// A contiguous n-dimensional array viewing a shared storage. Cloning is cheap (shares the
/// storage); use [`Tensor::deep_clone`] for a copy.
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<Storage>,
    offset: usize,
    shape: Vec<usize>,
    dtype: DType,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?}, {}, {}, offset {})",
            self.shape,
            self.dtype,
            self.device(),
            self.offset
        )
    }
}

/// A view of a storage that does not keep the storage alive ([`Tensor::downgrade`]).
#[doc(hidden)] // crate-internal, public only for the layers above
pub struct WeakTensor {
    storage: std::sync::Weak<Storage>,
    offset: usize,
    shape: Vec<usize>,
    dtype: DType,
}

impl WeakTensor {
    /// Whether some tensor still holds the storage (its memory is still in use).
    pub fn is_alive(&self) -> bool {
        self.storage.strong_count() > 0
    }

    /// Bytes the view covers, as [`Tensor::nbytes`].
    pub fn nbytes(&self) -> usize {
        numel_of(&self.shape) * self.dtype.size_in_bytes()
    }

    /// Whether `t` is this very view ([`Tensor::same_view`]).
    pub fn is_view_of(&self, t: &Tensor) -> bool {
        std::ptr::eq(self.storage.as_ptr(), Arc::as_ptr(&t.storage))
            && self.offset == t.offset
            && self.shape == t.shape
            && self.dtype == t.dtype
    }
}

/// Number of elements of a shape (1 for a scalar shape `[]`; 0 for a shape with a zero
/// dimension, however large the others: the product is not formed then, so it cannot
/// overflow).
pub fn numel_of(shape: &[usize]) -> usize {
    match shape.contains(&0) {
        true => 0,
        false => shape.iter().product(),
    }
}

impl Tensor {
    fn from_buffer(buf: Buffer, shape: &[usize]) -> Tensor {
        Self::from_buffer_at(buf, 0, shape)
    }

    /// A view of all of `storage` (one from the pool, counted live as it was taken).
    fn from_storage(storage: Storage, dtype: DType, shape: &[usize]) -> Tensor {
        Tensor {
            dtype,
            storage: Arc::new(storage),
            offset: 0,
            shape: shape.to_vec(),
        }
    }

    /// A view of `shape` at element `offset` of a new storage holding `buf` (a backend
    /// wrapping memory it allocated, e.g. a CUDA block).
    pub(crate) fn from_buffer_at(buf: Buffer, offset: usize, shape: &[usize]) -> Tensor {
        let dtype = buf.dtype();
        Tensor {
            storage: Arc::new(Storage::new(buf)),
            offset,
            shape: shape.to_vec(),
            dtype,
        }
    }

    /// Whether the storage is page-locked host memory (`Tensor.is_pinned()`): a CPU
    /// tensor the CUDA backend copies to and from asynchronously.
    pub fn is_pinned(&self) -> bool {
        matches!(&*self.storage.buf.read(), Buffer::Pinned { .. })
    }

    /// The host address of this view's first element when the storage is pinned (for the
    /// CUDA backend's asynchronous copies; valid while the storage lives).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend copies
    pub(crate) fn pinned_ptr(&self) -> Option<*mut u8> {
        match &*self.storage.buf.read() {
            Buffer::Pinned { buf, .. } => {
                let at = self.offset * self.dtype.size_in_bytes();
                // In bounds: a view never runs past its storage.
                Some(buf.as_ptr().wrapping_add(at))
            }
            _ => None,
        }
    }

    /// Whether no other tensor (clone or view) shares this tensor's storage: a buffer pool
    /// may then hand the storage to a new owner.
    pub fn is_sole_owner(&self) -> bool {
        Arc::strong_count(&self.storage) == 1
    }

    /// Read access to the whole storage buffer this tensor views (for the backends: a CUDA
    /// tensor's allocation).
    pub(crate) fn buffer(&self) -> parking_lot::RwLockReadGuard<'_, Buffer> {
        self.storage.buf.read()
    }

    /// The error for asking host data of a device tensor.
    pub(crate) fn not_on_host(&self, op: &'static str) -> Error {
        Error::DeviceMismatch {
            op,
            expected: Device::Cpu.to_string(),
            got: self.device().to_string(),
        }
    }

    /// Zero-filled CPU tensor (from the [buffer pool](pool) when it can). Aborts when the
    /// memory is not there, as `vec!` does; [`Tensor::try_zeros`] returns the error.
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        Self::from_storage(
            pool::take_storage(dtype, numel_of(shape), true),
            dtype,
            shape,
        )
    }

    /// [`Tensor::zeros`] for a shape that came from outside: the error instead of an abort.
    ///
    /// # Errors
    /// `InvalidArgument` for a shape whose size overflows; [`Error::OutOfMemory`] when the
    /// allocator cannot serve it.
    pub fn try_zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        let (numel, _) = alloc::checked_size(shape, dtype).map_err(Error::InvalidArgument)?;
        Ok(Self::from_storage(
            pool::try_take_storage(dtype, numel, true)?,
            dtype,
            shape,
        ))
    }

    /// A CPU f32 tensor whose every element the caller overwrites: a pooled buffer holding
    /// stale values when one of that length is free, else a new zeroed one (see
    /// [`pool`]). Never uninitialized memory.
    pub(crate) fn scratch_f32(shape: &[usize]) -> Tensor {
        Self::scratch(shape, DType::F32)
    }

    /// [`Tensor::scratch_f32`] in any host dtype.
    pub(crate) fn scratch(shape: &[usize], dtype: DType) -> Tensor {
        Self::from_storage(
            pool::take_storage(dtype, numel_of(shape), false),
            dtype,
            shape,
        )
    }

    /// [`Tensor::scratch`], or [`Error::OutOfMemory`].
    pub(crate) fn try_scratch(shape: &[usize], dtype: DType) -> Result<Tensor> {
        let (numel, _) = alloc::checked_size(shape, dtype).map_err(Error::InvalidArgument)?;
        Ok(Self::from_storage(
            pool::try_take_storage(dtype, numel, false)?,
            dtype,
            shape,
        ))
    }

    /// A tensor on `Device::Meta`: shape and dtype, no memory. Reading it is an error.
    pub fn meta(shape: &[usize], dtype: DType) -> Tensor {
        Self::from_buffer(
            Buffer::Meta {
                len: numel_of(shape),
                dtype,
                init: None,
            },
            shape,
        )
    }

    /// An f32 tensor on `Device::Meta` whose element `i` will be `init.value_at(i)` once
    /// materialized (deferred init: FSDP computes only the local shard's elements).
    pub fn meta_init(shape: &[usize], init: crate::init::ParamInit) -> Tensor {
        Self::from_buffer(
            Buffer::Meta {
                len: numel_of(shape),
                dtype: DType::F32,
                init: Some(init),
            },
            shape,
        )
    }

    /// For a meta tensor built with [`Tensor::meta_init`], its initializer and the element
    /// index of this view's first element; `None` otherwise.
    pub fn meta_initializer(&self) -> Option<(crate::init::ParamInit, u64)> {
        match &*self.storage.buf.read() {
            Buffer::Meta { init: Some(i), .. } => Some((*i, self.offset as u64)),
            _ => None,
        }
    }

    /// This tensor on the CPU: itself when it has memory, computed from its initializer
    /// when it is a meta tensor with one.
    ///
    /// # Errors
    /// `NotMaterialized` for a meta tensor without an initializer.
    pub fn materialize(&self) -> Result<Tensor> {
        if self.device() != Device::Meta {
            return Ok(self.clone());
        }
        match self.meta_initializer() {
            Some((init, start)) => {
                let mut v = alloc::zeroed_vec::<f32>(self.numel())?;
                init.fill(start, &mut v);
                Tensor::from_vec(v, &self.shape)
            }
            None => Err(Error::NotMaterialized {
                name: format!("meta tensor {:?}", self.shape),
                state: crate::error::Term::MetaWithoutValues.as_str(),
            }),
        }
    }

    /// CPU tensor owning `data`.
    ///
    /// # Errors
    /// `ShapeMismatch` when `data.len()` differs from the shape's element count.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        if data.len() != numel_of(shape) {
            return Err(Error::ShapeMismatch {
                op: "Tensor::from_vec",
                expected: shape.to_vec(),
                got: vec![data.len()],
            });
        }
        pool::count_allocation(data.len());
        let buf = T::into_buffer(data);
        Ok(Self::from_buffer(buf, shape))
    }

    /// Scalar (shape `[]`) f32 tensor.
    pub fn scalar(v: f32) -> Tensor {
        Self::from_buffer(Buffer::F32(vec![v]), &[])
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element count.
    pub fn numel(&self) -> usize {
        numel_of(&self.shape)
    }

    /// Bytes this view covers (`numel * dtype size`).
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Device of the storage.
    pub fn device(&self) -> Device {
        self.storage.device
    }

    /// Offset of this view in its storage, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// True when both tensors view the same storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// True when both are the same view of the same storage (same offset, shape and dtype):
    /// one tensor under two names, as a tied parameter is.
    pub fn same_view(&self, other: &Tensor) -> bool {
        self.shares_storage(other)
            && self.offset == other.offset
            && self.shape == other.shape
            && self.dtype == other.dtype
    }

    /// A handle that says whether this view's storage is still held, without holding it
    /// (what the saved-activation accounting counts during backward, `nn::saved`).
    #[doc(hidden)] // crate-internal, public only for the layers above
    pub fn downgrade(&self) -> WeakTensor {
        WeakTensor {
            storage: Arc::downgrade(&self.storage),
            offset: self.offset,
            shape: self.shape.clone(),
            dtype: self.dtype,
        }
    }

    /// A view of `numel_of(shape)` elements starting `offset` elements into this tensor,
    /// sharing storage (no copy).
    ///
    /// # Errors
    /// `InvalidArgument` when the window runs past the end of this tensor.
    pub fn view(&self, offset: usize, shape: &[usize]) -> Result<Tensor> {
        let n = numel_of(shape);
        if offset + n > self.numel() {
            crate::error::bail_arg!(
                "view of {n} elements at offset {offset} runs past a tensor of {} elements",
                self.numel()
            );
        }
        Ok(Tensor {
            storage: self.storage.clone(),
            offset: self.offset + offset,
            shape: shape.to_vec(),
            dtype: self.dtype,
        })
    }

    /// Same elements, another shape of the same element count (shares storage).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if numel_of(shape) != self.numel() {
            return Err(Error::ShapeMismatch {
                op: "reshape",
                expected: self.shape.clone(),
                got: shape.to_vec(),
            });
        }
        self.view(0, shape)
    }

    /// Read access to the elements as `&[T]`.
    ///
    /// # Errors
    /// `DTypeMismatch` when `T` is not this tensor's dtype; `NotMaterialized` on meta.
    pub fn data<T: Element>(&self) -> Result<MappedRwLockReadGuard<'_, [T]>> {
        self.check_access::<T>("Tensor::data")?;
        let (lo, hi) = (self.offset, self.offset + self.numel());
        let guard = self.storage.buf.read();
        Ok(RwLockReadGuard::map(guard, |b| {
            &buffer_slice::<T>(b)[lo..hi]
        }))
    }

    /// Write access to the elements as `&mut [T]`.
    ///
    /// # Errors
    /// As [`Tensor::data`].
    pub fn data_mut<T: Element>(&self) -> Result<MappedRwLockWriteGuard<'_, [T]>> {
        self.check_access::<T>("Tensor::data_mut")?;
        let (lo, hi) = (self.offset, self.offset + self.numel());
        let guard = self.storage.buf.write();
        Ok(RwLockWriteGuard::map(guard, |b| {
            &mut buffer_slice_mut::<T>(b)[lo..hi]
        }))
    }

    /// Shorthand for `data::<f32>()`.
    pub fn f32(&self) -> Result<MappedRwLockReadGuard<'_, [f32]>> {
        self.data::<f32>()
    }

    /// Shorthand for `data_mut::<f32>()`.
    pub fn f32_mut(&self) -> Result<MappedRwLockWriteGuard<'_, [f32]>> {
        self.data_mut::<f32>()
    }

    fn check_access<T: Element>(&self, op: &'static str) -> Result<()> {
        if self.device() == Device::Meta {
            return Err(Error::NotMaterialized {
                name: format!("{self:?}"),
                state: "meta",
            });
        }
        if self.device().is_cuda() {
            return Err(self.not_on_host(op));
        }
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch {
                op,
                expected: self.dtype,
                got: T::DTYPE,
            });
        }
        Ok(())
    }
}

fn buffer_slice<T: Element>(b: &Buffer) -> &[T] {
    match b {
        Buffer::F32(v) => bytemuck::cast_slice(v),
        Buffer::BF16(v) => bytemuck::cast_slice(v),
        Buffer::F16(v) => bytemuck::cast_slice(v),
        Buffer::I32(v) => bytemuck::cast_slice(v),
        Buffer::F64(v) => bytemuck::cast_slice(v),
        Buffer::I64(v) => bytemuck::cast_slice(v),
        Buffer::Pinned { buf, .. } => {
            // SAFETY: the allocation holds `len_bytes` bytes, valid while `b` is borrowed
            // (the storage owns the allocation); the storage's lock is held for reading.
            let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr(), buf.len_bytes()) };
            bytemuck::cast_slice(bytes)
        }
        Buffer::Meta { .. } => &[],
        Buffer::Cuda { .. } => &[],
    }
}

fn buffer_slice_mut<T: Element>(b: &mut Buffer) -> &mut [T] {
    match b {
        Buffer::F32(v) => bytemuck::cast_slice_mut(v),
        Buffer::BF16(v) => bytemuck::cast_slice_mut(v),
        Buffer::F16(v) => bytemuck::cast_slice_mut(v),
        Buffer::I32(v) => bytemuck::cast_slice_mut(v),
        Buffer::F64(v) => bytemuck::cast_slice_mut(v),
        Buffer::I64(v) => bytemuck::cast_slice_mut(v),
        Buffer::Pinned { buf, .. } => {
            // SAFETY: as in `buffer_slice`; the storage's lock is held for writing, so this
            // is the only reference to the bytes on the host.
            let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), buf.len_bytes()) };
            bytemuck::cast_slice_mut(bytes)
        }
        Buffer::Meta { .. } => &mut [],
        Buffer::Cuda { .. } => &mut [],
    }
}
