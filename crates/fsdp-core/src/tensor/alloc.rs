//! Fallible host allocation: where a size that came from outside (a host's declared shape,
//! a DLPack tensor, a checkpoint) turns into host memory, an allocation that cannot be
//! served is an [`Error::OutOfMemory`] naming the bytes, never the allocator's abort
//! (`memory allocation of N bytes failed`). Sizes are checked before they are multiplied:
//! a shape whose element or byte count overflows `usize` is an `InvalidArgument`.
//!
//! `vec![0; n]` asks the allocator for zeroed memory (`calloc`): the pages are the kernel's
//! zero pages until written. [`zeroed_vec`] does the same through
//! [`std::alloc::alloc_zeroed`], so the fallible path costs what the infallible one did.

use crate::dtype::DType;
use crate::error::{Error, Result};

/// The element count of `shape` and its size in bytes as `dtype`; `Err` says which of the
/// two overflows `usize` (a shape no memory can hold), for the caller to name the tensor.
/// A shape with a zero dimension holds no element, however large its other dimensions
/// (`[0, 2^62]`, or `[2^62, 2^62, 0]` whose leading product alone would overflow): `(0, 0)`.
pub fn checked_size(shape: &[usize], dtype: DType) -> std::result::Result<(usize, usize), String> {
    let numel = match shape.contains(&0) {
        true => Some(0),
        false => shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)),
    };
    match numel.and_then(|n| Some((n, n.checked_mul(dtype.size_in_bytes())?))) {
        Some(s) => Ok(s),
        None => Err(format!(
            "shape {shape:?}: its {} overflows the address space ({} bits)",
            if numel.is_none() {
                "element count"
            } else {
                "size in bytes"
            },
            usize::BITS
        )),
    }
}

fn out_of_memory(len: usize, size: usize, dtype: DType) -> Error {
    Error::OutOfMemory {
        bytes: len.saturating_mul(size),
        what: format!("a host buffer of {len} {dtype} elements"),
    }
}

/// `len` zeros (`vec![T::zeroed(); len]`), or [`Error::OutOfMemory`].
pub fn zeroed_vec<T: super::Element>(len: usize) -> Result<Vec<T>> {
    let size = std::mem::size_of::<T>();
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout =
        std::alloc::Layout::array::<T>(len).map_err(|_| out_of_memory(len, size, T::DTYPE))?;
    // SAFETY: the layout's size is not zero (len > 0 and every Element is a scalar of at
    // least 2 bytes).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    if ptr.is_null() {
        return Err(out_of_memory(len, size, T::DTYPE));
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `[T; len]` (what a
    // Vec of capacity `len` frees with), and holds `len` zeroed `T`s, each a valid value
    // (`Pod`).
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// A copy of `src` in a new vector, or [`Error::OutOfMemory`].
pub fn vec_from_slice<T: super::Element>(src: &[T]) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(src.len())
        .map_err(|_| out_of_memory(src.len(), std::mem::size_of::<T>(), T::DTYPE))?;
    v.extend_from_slice(src);
    Ok(v)
}

/// An empty vector with room for `len` elements, or [`Error::OutOfMemory`].
pub fn vec_with_capacity<T: super::Element>(len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| out_of_memory(len, std::mem::size_of::<T>(), T::DTYPE))?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors_not_aborts() {
        // 2^61 f32: 8 EiB, beyond any address space, yet no overflow.
        let e = zeroed_vec::<f32>(1 << 61).unwrap_err();
        assert!(
            e.to_string().contains("needs 9223372036854775808 bytes"),
            "{e}"
        );
        assert!(matches!(e, Error::OutOfMemory { .. }));
        let e = vec_with_capacity::<f64>(1 << 60).unwrap_err();
        assert!(matches!(e, Error::OutOfMemory { bytes, .. } if bytes == 1 << 63));
        assert_eq!(zeroed_vec::<f32>(3).unwrap(), vec![0.0; 3]);
        assert_eq!(vec_from_slice(&[1i32, 2]).unwrap(), vec![1, 2]);
        assert_eq!(checked_size(&[2, 3], DType::F32).unwrap(), (6, 24));
        let e = checked_size(&[1 << 40, 1 << 40], DType::F32).unwrap_err();
        assert!(e.contains("its element count overflows"), "{e}");
        let e = checked_size(&[1 << 62], DType::F32).unwrap_err();
        assert!(e.contains("its size in bytes overflows"), "{e}");
        // A zero dimension anywhere: no element, even after a product that overflows.
        assert_eq!(checked_size(&[0, 1 << 62], DType::F32).unwrap(), (0, 0));
        assert_eq!(
            checked_size(&[1 << 62, 1 << 62, 0], DType::F32).unwrap(),
            (0, 0)
        );
        assert_eq!(crate::tensor::numel_of(&[1 << 62, 1 << 62, 0]), 0);
        assert_eq!(checked_size(&[], DType::F64).unwrap(), (1, 8));
    }
}
