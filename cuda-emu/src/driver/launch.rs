//! Modules (the fat binaries are not read: every kernel is compiled in) and launches.

use super::*;

extern "C" {
    fn emu_find_kernel(name: *const c_char) -> *const c_void;
    fn emu_check_pointers(kernel: *const c_void, params: *mut *mut c_void) -> c_int;
    fn emu_param_sizes(kernel: *const c_void, n: *mut usize) -> *const usize;
    fn emu_launch(
        kernel: *const c_void,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        by: c_uint,
        bz: c_uint,
        params: *mut *mut c_void,
    ) -> c_int;
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(
    module: *mut *mut c_void,
    image: *const c_void,
) -> CUresult {
    let device = try_cu!(current());
    if image.is_null() {
        return INVALID_VALUE;
    }
    // The image (nvcc's fat binary) is not read: every kernel of kernels/*.cu is compiled in.
    unsafe {
        out(
            module,
            Box::into_raw(Box::new(ModuleObj { device })) as *mut c_void,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(module: *mut c_void) -> CUresult {
    // SAFETY: made by cuModuleLoadData, unloaded once. Its functions are leaked on purpose.
    match unsafe { free_handle::<ModuleObj>(module) } {
        true => SUCCESS,
        false => INVALID_HANDLE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> CUresult {
    try_cu!(current());
    if module.is_null() || name.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuModuleLoadData; name is a C string.
    let device = unsafe { (*(module as *const ModuleObj)).device };
    let kernel = unsafe { emu_find_kernel(name) };
    if kernel.is_null() {
        return NOT_FOUND;
    }
    unsafe {
        out(
            f,
            Box::into_raw(Box::new(FunctionObj { device, kernel })) as *mut c_void,
        )
    }
}

#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared_bytes: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let dev = try_cu!(unsafe { on_stream(stream) });
    if f.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuModuleGetFunction.
    let func = unsafe { &*(f as *const FunctionObj) };
    if func.device != dev {
        return INVALID_HANDLE;
    }
    if !extra.is_null() || shared_bytes != 0 || params.is_null() {
        return INVALID_VALUE; // fsdp passes parameters by kernelParams, no dynamic shared memory
    }
    // SAFETY: params holds one pointer per kernel parameter (the caller's contract).
    if unsafe { emu_check_pointers(func.kernel, params) } != 0 {
        return INVALID_VALUE;
    }
    // The device's limits (the runtime checks them again when the launch runs).
    let block_ok = (1..=1024).contains(&bx) && by == 1 && bz == 1;
    let grid_ok = gx >= 1
        && gx <= i32::MAX as c_uint
        && (1..=65535).contains(&gy)
        && (1..=65535).contains(&gz);
    if !block_ok || !grid_ok {
        return INVALID_VALUE;
    }
    // The driver copies the argument values at launch: keep them, one 8-byte slot each.
    let mut n = 0usize;
    // SAFETY: a kernel of the table; `sizes` has `n` entries.
    let sizes = unsafe { std::slice::from_raw_parts(emu_param_sizes(func.kernel, &mut n), n) };
    let mut slots = vec![0u64; n];
    for (i, (&size, slot)) in sizes.iter().zip(slots.iter_mut()).enumerate() {
        // SAFETY: params[i] points at a value of the kernel's parameter i (the caller's
        // contract); at most 8 bytes are read, into an 8-byte slot.
        unsafe {
            std::ptr::copy_nonoverlapping(
                *params.add(i) as *const u8,
                slot as *mut u64 as *mut u8,
                size.min(8),
            )
        };
    }
    let kernel = func.kernel as usize;
    let run = move || {
        let mut slots = slots.clone();
        let mut ptrs: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: geometry and pointers were checked at issue, and the memory stays allocated
        // until the device's work has run (a free drains it first).
        let r = unsafe {
            emu_launch(
                kernel as *const c_void,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                ptrs.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0, "cuda-emu: a launch checked at issue was refused");
    };
    try_cu!(queue::issue(stream as usize, dev, Work::new(run)));
    SUCCESS
}
