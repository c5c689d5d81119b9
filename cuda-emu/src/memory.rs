//! Emulated device memory: each `cuMemAlloc` is its own anonymous mapping, ending at a
//! `PROT_NONE` guard page, filled with `0xff`; a table of live allocations answers the range
//! checks of copies, memsets and kernel pointer arguments.
//!
//! Page-locked host memory (`cuMemHostAlloc`) is a mapping of its own too, in a second
//! table: a host-device copy whose host side lies wholly in one is asynchronous
//! (`driver/copies.rs`).

use std::collections::BTreeMap;
use std::sync::Mutex;

const PAGE: usize = 4096;
/// The device's allocation alignment.
const ALIGN: usize = 256;

struct Alloc {
    len: usize,
    device: i32,
    map_base: usize,
    map_len: usize,
}

static ALLOCS: Mutex<BTreeMap<usize, Alloc>> = Mutex::new(BTreeMap::new());

fn table() -> std::sync::MutexGuard<'static, BTreeMap<usize, Alloc>> {
    ALLOCS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bytes allocated on `device` now.
pub fn used(device: i32) -> usize {
    table()
        .values()
        .filter(|a| a.device == device)
        .map(|a| a.len)
        .sum()
}

/// A fresh anonymous private read-write mapping of `map_len` bytes: its base address, or
/// None when the mapping fails.
fn anon_map(map_len: usize) -> Option<usize> {
    // SAFETY: an anonymous private mapping; nothing else refers to it yet.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    Some(base as usize)
}

/// A new allocation of `len` bytes (at least 1) on `device`, or None when the mapping fails.
pub fn alloc(len: usize, device: i32) -> Option<usize> {
    let len = len.max(1);
    let body = len.div_ceil(PAGE) * PAGE;
    let map_len = body + PAGE;
    let base = anon_map(map_len)?;
    // SAFETY: the last page of our own mapping.
    unsafe { libc::mprotect((base + body) as *mut libc::c_void, PAGE, libc::PROT_NONE) };
    let start = base + body - len.div_ceil(ALIGN) * ALIGN;
    // SAFETY: [start, start + len) lies in the writable part of the mapping.
    unsafe { std::ptr::write_bytes(start as *mut u8, 0xff, len) };
    table().insert(
        start,
        Alloc {
            len,
            device,
            map_base: base,
            map_len,
        },
    );
    Some(start)
}

/// Live page-locked host allocations: start -> (length, mapping base, mapping length).
static PINNED: Mutex<BTreeMap<usize, (usize, usize, usize)>> = Mutex::new(BTreeMap::new());

fn pinned() -> std::sync::MutexGuard<'static, BTreeMap<usize, (usize, usize, usize)>> {
    PINNED.lock().unwrap_or_else(|p| p.into_inner())
}

/// A new page-locked host allocation of `len` bytes (at least 1), page aligned and filled
/// with `0xff` (its contents are undefined, as `cuMemHostAlloc`'s), or None.
pub fn host_alloc(len: usize) -> Option<usize> {
    let len = len.max(1);
    let map_len = len.div_ceil(PAGE) * PAGE;
    let base = anon_map(map_len)?;
    // SAFETY: the mapping is `map_len >= len` writable bytes.
    unsafe { std::ptr::write_bytes(base as *mut u8, 0xff, len) };
    pinned().insert(base, (len, base, map_len));
    Some(base)
}

/// Frees the page-locked allocation starting at `ptr`; false when none starts there.
pub fn host_free(ptr: usize) -> bool {
    let Some((_, base, map_len)) = pinned().remove(&ptr) else {
        return false;
    };
    // SAFETY: the mapping made by `host_alloc`, no longer in the table.
    unsafe { libc::munmap(base as *mut libc::c_void, map_len) };
    true
}

/// Whether `[ptr, ptr + len)` lies wholly in one live page-locked host allocation.
pub fn is_pinned(ptr: usize, len: usize) -> bool {
    let t = pinned();
    let Some((start, (n, _, _))) = t.range(..=ptr).next_back() else {
        return false;
    };
    ptr.checked_add(len).is_some_and(|end| end <= start + n)
}

/// Frees the allocation starting at `ptr`; false when no live allocation starts there.
pub fn free(ptr: usize) -> bool {
    let Some(a) = table().remove(&ptr) else {
        return false;
    };
    // SAFETY: the mapping made by `alloc`, no longer in the table.
    unsafe { libc::munmap(a.map_base as *mut libc::c_void, a.map_len) };
    true
}

/// The device of the live allocation holding `[ptr, ptr + len)`, or None.
pub fn device_of(ptr: usize, len: usize) -> Option<i32> {
    let t = table();
    let (start, a) = t.range(..=ptr).next_back()?;
    let end = start + a.len.div_ceil(ALIGN) * ALIGN;
    (ptr.checked_add(len)? <= end).then_some(a.device)
}

/// Whether `ptr` is null or points into (or one past the end of) a live allocation of the
/// current context's device: a kernel reading another GPU's memory faults without peer
/// access, which fsdp never enables (it copies between devices instead).
#[no_mangle]
pub extern "C" fn emu_pointer_ok(ptr: *const libc::c_void) -> libc::c_int {
    let p = ptr as usize;
    (p == 0 || (device_of(p, 0).is_some() && device_of(p, 0) == crate::driver::current_device()))
        as libc::c_int
}
