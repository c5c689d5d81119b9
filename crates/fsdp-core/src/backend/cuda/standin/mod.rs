//! The CUDA backend of a build without the `cuda` feature: the same names and signatures
//! as the real modules, so that the ops, process groups and FSDP above name
//! `backend::cuda` in one code path and never the feature (candle's
//! `dummy_cuda_backend.rs` is the model).
//!
//! Nothing here can run. The handles ([`Stream`], [`Event`], [`DeviceTensor`], ...) hold
//! an uninhabited value, so no stand-in handle exists and every method on one is
//! statically unreachable (`match self.never {}`); the entry points that make handles
//! ([`current_stream`], [`CudaDevice::get`], [`pinned_zeros`], ...) return
//! [`no_cuda_build`]'s error. A `Device::Cuda` tensor cannot be made in this build, so an
//! op reaches its CUDA arm only through one of those entry points, and gets that error.
//!
//! The compiler keeps this file and the real modules in step: a call above that does not
//! fit both fails one of the two builds (CI builds both).

#![allow(unused_variables)] // the stand-ins keep the real parameter names

#[doc(hidden)] // crate-internal, public only for the layers above
pub mod collective;
mod ops;

pub use ops::*;

use super::no_cuda_build;
use super::MemAccount;
use crate::error::Result;
use crate::tensor::{DType, Tensor};
use std::sync::Arc;

/// No value: the stand-in handles hold one, so none of them can exist.
#[derive(Debug, Clone, Copy)]
enum Never {}

/// Declares stand-in handle types, each holding a [`Never`].
macro_rules! handles {
    ($($(#[$m:meta])* $name:ident),* $(,)?) => {$(
        $(#[$m])*
        #[derive(Debug, Clone)]
        pub struct $name {
            #[allow(dead_code)] // never read where no method takes the handle
            never: Never,
        }
    )*};
}

handles! {
    /// A CUDA stream (stand-in; see the module docs).
    Stream,
    /// A CUDA event (stand-in).
    Event,
    /// A tensor in device memory (stand-in).
    DeviceTensor,
    /// A block of device memory (stand-in).
    DeviceBuffer,
    /// A CUDA device with its context and kernel modules (stand-in).
    CudaDevice,
    /// Captures a step as a CUDA graph (stand-in).
    GraphRecorder,
    /// A captured step (stand-in).
    StepGraph,
    /// The guard of [`use_stream`] (stand-in).
    StreamGuard,
    /// A device-side list of tensors (stand-in).
    TensorList,
    /// A device-side sum of squares (stand-in).
    NormAccumulator,
    /// Page-locked host memory (stand-in).
    PinnedBuffer,
}

// The entry points that need no handle: the answers of a process with no CUDA device.

/// Stand-in: the error of every CUDA entry point ([`no_cuda_build`]).
pub fn current_stream(ordinal: usize) -> Result<Arc<Stream>> {
    Err(no_cuda_build())
}

/// Stand-in: a fresh account (nothing is ever charged to it).
pub fn rank_account() -> Arc<MemAccount> {
    MemAccount::new()
}

/// Stand-in: nothing to set (no buffer is ever charged).
pub fn set_rank_account(account: Arc<MemAccount>) {}

/// Stand-in: nothing to time.
pub fn time_stream_waits(on: bool) {}

/// Stand-in: no capture can be under way; runs `f`.
pub fn outside_captures<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Stand-in: no stream ever stood still.
pub fn take_stream_stall_s() -> f64 {
    0.0
}

/// Stand-in: runs `f` (there are no device blocks).
pub fn with_fresh_blocks<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Stand-in: no pair of tensors here is a CUDA/pinned pair, so nothing is queued.
pub(crate) fn copy_async(dst: &Tensor, src: &Tensor) -> Result<bool> {
    Ok(false)
}

/// Stand-in (see the module docs).
pub fn pinned_zeros(shape: &[usize], dtype: DType, ordinal: usize) -> Result<Tensor> {
    Err(no_cuda_build())
}

/// Stand-in (see the module docs).
pub fn use_stream(stream: Arc<Stream>) -> StreamGuard {
    match stream.never {}
}

impl Stream {
    /// Stand-in (see the module docs).
    pub fn new(dev: &Arc<CudaDevice>, account: Arc<MemAccount>) -> Result<Stream> {
        match dev.never {}
    }

    /// Stand-in (see the module docs).
    pub fn is_capturing(&self) -> Result<bool> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn device(&self) -> &Arc<CudaDevice> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn record(&self) -> Result<Event> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn wait(&self, event: &Event) -> Result<()> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn wait_timed(&self, event: &Event) -> Result<()> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn record_use(&self, buf: &DeviceBuffer) {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn synchronize(&self) -> Result<()> {
        match self.never {}
    }
}

impl CudaDevice {
    /// Stand-in: [`no_cuda_build`]'s error.
    pub fn get(ordinal: usize) -> Result<Arc<CudaDevice>> {
        Err(no_cuda_build())
    }

    /// Stand-in (see the module docs).
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }
}

impl DeviceTensor {
    /// Stand-in (see the module docs).
    pub fn empty(stream: &Stream, shape: &[usize], dtype: DType) -> Result<DeviceTensor> {
        Err(no_cuda_build())
    }

    /// Stand-in (see the module docs).
    pub fn copy_from_slice<T: crate::tensor::Element>(
        &self,
        stream: &Stream,
        data: &[T],
    ) -> Result<()> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn to_host(&self, stream: &Stream) -> Result<Tensor> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn zeros(stream: &Stream, shape: &[usize], dtype: DType) -> Result<DeviceTensor> {
        Err(no_cuda_build())
    }

    pub(crate) fn from_parts(
        buf: Arc<DeviceBuffer>,
        offset: usize,
        shape: &[usize],
        dtype: DType,
    ) -> DeviceTensor {
        match buf.never {}
    }

    pub(crate) fn into_parts(self) -> (Arc<DeviceBuffer>, usize, Vec<usize>, DType) {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn ptr(&self) -> u64 {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn buffer(&self) -> &DeviceBuffer {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn copy_from_device(&self, stream: &Stream, src: &DeviceTensor) -> Result<()> {
        match self.never {}
    }
}

impl DeviceBuffer {
    /// Stand-in (see the module docs).
    pub fn ptr(&self) -> u64 {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn len_bytes(&self) -> usize {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }
}

impl GraphRecorder {
    /// Stand-in (see the module docs).
    pub fn new(stream: &Arc<Stream>) -> Result<GraphRecorder> {
        match stream.never {}
    }

    /// Stand-in (see the module docs).
    pub fn set_lr_table(&mut self, lrs: Vec<f32>) -> Result<()> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn warm_up<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn capture<R>(self, f: impl FnOnce() -> Result<R>) -> Result<(StepGraph, R)> {
        match self.never {}
    }
}

impl StepGraph {
    /// Stand-in (see the module docs).
    pub fn launch(&self) -> Result<()> {
        match self.never {}
    }
}

impl TensorList {
    /// Stand-in (see the module docs).
    pub fn new(s: &Stream, xs: &[DeviceTensor]) -> Result<TensorList> {
        match s.never {}
    }
}

impl NormAccumulator {
    /// Stand-in (see the module docs).
    pub fn add_squares(&self, s: &Stream, x: &DeviceTensor) -> Result<()> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn store(&self, s: &Stream, out: &DeviceTensor) -> Result<()> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn zeros(s: &Stream) -> Result<NormAccumulator> {
        Err(no_cuda_build())
    }

    /// Stand-in (see the module docs).
    pub fn unset(s: &Stream) -> Result<NormAccumulator> {
        match s.never {}
    }

    /// Stand-in (see the module docs).
    pub fn set_squares(
        &self,
        s: &Stream,
        list: &TensorList,
        narrow: Option<&DeviceTensor>,
    ) -> Result<()> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn load(&self, s: &Stream, x: &DeviceTensor) -> Result<()> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn clip_coef(
        &self,
        s: &Stream,
        max_norm: f64,
        norm: &DeviceTensor,
        coef: &DeviceTensor,
    ) -> Result<()> {
        match self.never {}
    }

    /// Stand-in (see the module docs).
    pub fn clip_coef_of(
        &self,
        s: &Stream,
        total: &DeviceTensor,
        max_norm: f64,
        norm: &DeviceTensor,
        coef: &DeviceTensor,
    ) -> Result<()> {
        match self.never {}
    }
}

impl crate::tensor::DeviceAllocation for DeviceBuffer {
    fn ordinal(&self) -> usize {
        match self.never {}
    }

    fn len_bytes(&self) -> usize {
        match self.never {}
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}
