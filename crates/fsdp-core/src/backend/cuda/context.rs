//! [`CudaDevice`]: one per ordinal, created on first use and shared by every rank and stream
//! on that GPU: the driver's primary context, the kernel modules (loaded once, lazily, from
//! the fat binaries build.rs embedded) and the caching allocator's pool.

use super::memory::Pool;
use super::DeviceInfo;
use crate::error::{Error, Result};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// A GPU: context, loaded kernel modules and memory pool. Get one with
/// [`CudaDevice::get`]; clones of the `Arc` share everything.
pub struct CudaDevice {
    pub(crate) ctx: Arc<CudaContext>,
    ordinal: usize,
    info: DeviceInfo,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: FunctionCache,
    pub(crate) pool: Arc<Pool>,
}

/// Kernels resolved so far, by name, read without a lock: an open-addressing table of
/// write-once slots. A launch looks its kernel up here, so after the first launch of each
/// kernel no launch takes a lock or calls the driver to find it (issue: a device-wide
/// mutex per launch serialized every rank's stream threads).
struct FunctionCache {
    slots: Box<[OnceLock<(&'static str, CudaFunction)>]>,
}

impl FunctionCache {
    /// Room for every kernel of `kernels/*.cu` several times over (they number ~120).
    const SLOTS: usize = 1024;

    fn new() -> FunctionCache {
        FunctionCache {
            slots: (0..Self::SLOTS).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The kernel `name`, resolved by `resolve` on its first use. Two threads that resolve
    /// the same kernel at once both get it; one of them fills the slot.
    fn get(
        &self,
        name: &'static str,
        resolve: impl FnOnce() -> Result<CudaFunction>,
    ) -> Result<cudarc::driver::sys::CUfunction> {
        let n = self.slots.len();
        let start = crate::hash::fnv1a(name.as_bytes()) as usize % n;
        let mut resolve = Some(resolve);
        for i in 0..n {
            let slot = &self.slots[(start + i) % n];
            if slot.get().is_none() {
                let Some(r) = resolve.take() else { break };
                let f = r()?;
                let (k, got) = slot.get_or_init(|| (name, f.clone()));
                if *k != name {
                    // Another kernel took the slot meanwhile: ours works without caching.
                    return Ok(f.cu_function());
                }
                return Ok(got.cu_function());
            }
            match slot.get() {
                Some((k, f)) if *k == name => return Ok(f.cu_function()),
                _ => continue,
            }
        }
        // A full table (never with today's kernels): resolve without caching.
        match resolve {
            Some(r) => r().map(|f| f.cu_function()),
            None => Err(Error::Fsdp(format!("internal: kernel {name} not cached"))),
        }
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice(cuda:{}, {})", self.ordinal, self.info.name)
    }
}

/// Checks that libcuda can be loaded before any cudarc call (which would panic otherwise).
fn require_driver() -> Result<()> {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    if !present {
        return Err(Error::cuda(
            "no CUDA driver found (libcuda.so)",
            "the NVIDIA driver library could not be loaded; this machine has no GPU driver, \
             or it is not on the loader path (LD_LIBRARY_PATH)",
        ));
    }
    Ok(())
}

/// See [`super::detect`].
pub(crate) fn detect() -> Result<Vec<DeviceInfo>> {
    require_driver()?;
    let n = CudaContext::device_count()
        .map_err(|e| Error::cuda("initializing the CUDA driver (cuInit)", e))?;
    if n <= 0 {
        return Err(Error::cuda(
            "no CUDA device",
            "the driver loaded but reports no device: check CUDA_VISIBLE_DEVICES (under cuda-emu, CUDA_EMU_DEVICES)",
        ));
    }
    (0..n as usize)
        .map(|i| CudaDevice::get(i).map(|d| d.info.clone()))
        .collect()
}

fn registry() -> &'static Mutex<HashMap<usize, Arc<CudaDevice>>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

impl CudaDevice {
    /// The device `cuda:ordinal`, created on first call (context retained, nothing loaded
    /// yet) and shared afterwards.
    ///
    /// # Errors
    /// [`Error::Cuda`] without a driver (`"no CUDA driver found (libcuda.so)"`), for an
    /// ordinal the driver does not have, or when the context cannot be created.
    pub fn get(ordinal: usize) -> Result<Arc<CudaDevice>> {
        let mut reg = registry().lock();
        if let Some(d) = reg.get(&ordinal) {
            return Ok(d.clone());
        }
        require_driver()?;
        let count = CudaContext::device_count()
            .map_err(|e| Error::cuda("initializing the CUDA driver (cuInit)", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::cuda(
                format!("cuda:{ordinal}"),
                format!("no such device: the driver reports {count} device(s)"),
            ));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| Error::cuda(format!("creating a context on cuda:{ordinal}"), e))?;
        let attr = |a| {
            ctx.attribute(a)
                .map_err(|e| Error::cuda(format!("reading attributes of cuda:{ordinal}"), e))
        };
        let info = DeviceInfo {
            ordinal,
            name: ctx
                .name()
                .map_err(|e| Error::cuda(format!("reading the name of cuda:{ordinal}"), e))?,
            compute_capability: (
                attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            total_memory: ctx
                .total_mem()
                .map_err(|e| Error::cuda(format!("reading the memory of cuda:{ordinal}"), e))?,
            multiprocessors: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                .max(1) as usize,
        };
        let dev = Arc::new(CudaDevice {
            pool: Arc::new(Pool::new(ctx.clone(), ordinal)),
            ctx,
            ordinal,
            info,
            modules: Mutex::new(HashMap::new()),
            functions: FunctionCache::new(),
        });
        reg.insert(ordinal, dev.clone());
        Ok(dev)
    }

    /// Makes this device's context current on the calling thread (for libraries that use
    /// the current context, such as NCCL's communicator creation).
    ///
    /// # Errors
    /// [`Error::Cuda`] from the driver.
    pub fn bind_to_thread(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda(format!("binding cuda:{} to this thread", self.ordinal), e))
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// What the driver reports about this device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The driver handle of kernel `name` of module `module` (`kernels/{module}.cu`),
    /// loading the module on first use. Functions are cached by name; once cached, a
    /// lookup takes no lock. The handle stays valid for the device's life (its module is
    /// never unloaded).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the module is not embedded, the driver rejects the image (no
    /// cubin or PTX usable on this GPU: see [`crate::kernels::targets`]), or the module has
    /// no such kernel (a bf16 kernel on a pre-sm_80 GPU, say).
    pub(crate) fn function(
        &self,
        module: &'static str,
        name: &'static str,
    ) -> Result<cudarc::driver::sys::CUfunction> {
        self.functions.get(name, || {
            let m = self.module(module)?;
            m.load_function(name).map_err(|e| {
                Error::cuda(
                    format!(
                        "loading kernel {name} from module {module} on cuda:{}",
                        self.ordinal
                    ),
                    e,
                )
            })
        })
    }

    fn module(&self, module: &'static str) -> Result<Arc<CudaModule>> {
        let mut mods = self.modules.lock();
        if let Some(m) = mods.get(module) {
            return Ok(m.clone());
        }
        let image = crate::kernels::fatbin(module).ok_or_else(|| {
            Error::cuda(
                format!("loading module {module}"),
                format!(
                    "no such embedded module (have: {:?})",
                    crate::kernels::module_names()
                ),
            )
        })?;
        let (maj, min) = self.info.compute_capability;
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(image.to_vec()))
            .map_err(|e| {
                Error::cuda(
                    format!(
                        "loading module {module} (targets {}) on cuda:{} (sm_{maj}{min})",
                        crate::kernels::targets(),
                        self.ordinal
                    ),
                    e,
                )
            })?;
        mods.insert(module, m.clone());
        Ok(m)
    }

    /// Blocks until all work on every stream of this device finished.
    ///
    /// # Errors
    /// [`Error::Cuda`] carrying the first asynchronous error (e.g. a faulting kernel).
    pub fn synchronize(&self) -> Result<()> {
        crate::backend::counters::count_host_sync();
        self.ctx
            .synchronize()
            .map_err(|e| Error::cuda(format!("synchronizing cuda:{}", self.ordinal), e))
    }

    /// Grid size for an elementwise kernel over `n` elements with `block` threads: enough
    /// blocks to cover `n`, at most 32 per multiprocessor (grid-stride loops do the rest;
    /// 32 x 256 threads keeps every SM full without a tail of tiny blocks), at least 1.
    pub(crate) fn grid_for(&self, n: usize, block: u32) -> u32 {
        let cap = (self.info.multiprocessors * 32).max(1);
        n.div_ceil(block as usize).clamp(1, cap) as u32
    }
}
