//! [`Element`]: the trait that maps a Rust scalar to its [`DType`] and to a storage
//! [`Buffer`] of that type.

use super::Buffer;
use crate::dtype::DType;
use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for i32 {}
    impl Sealed for f64 {}
    impl Sealed for i64 {}
}

/// A Rust scalar type that a tensor can hold: exactly f32, bf16, f16, i32, f64 and i64 (sealed).
pub trait Element:
    sealed::Sealed + Copy + Send + Sync + bytemuck::Pod + std::fmt::Debug + 'static
{
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Widening conversion used by reductions (exact for every type but large i32).
    fn to_f32(self) -> f32;
    /// Narrowing conversion with round-to-nearest-even.
    fn from_f32(v: f32) -> Self;
    /// The additive identity.
    fn zero() -> Self;
    /// Moves a vector of this type into the matching [`Buffer`] variant.
    fn into_buffer(v: Vec<Self>) -> Buffer;
    /// Widening conversion used by cross-rank reductions (exact for every type).
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    /// Narrowing conversion from a reduction's accumulator (one rounding).
    fn from_f64(v: f64) -> Self {
        Self::from_f32(v as f32)
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::F32(v)
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn zero() -> Self {
        0.0
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::BF16(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn zero() -> Self {
        bf16::ZERO
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::F16(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn zero() -> Self {
        f16::ZERO
    }
}

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::I32(v)
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(v: f32) -> Self {
        v as i32
    }
    fn zero() -> Self {
        0
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v.round() as i32
    }
}

impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::F64(v)
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(v: f32) -> Self {
        v as f64
    }
    fn zero() -> Self {
        0.0
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}

impl Element for i64 {
    const DTYPE: DType = DType::I64;
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::I64(v)
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(v: f32) -> Self {
        v as i64
    }
    fn zero() -> Self {
        0
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v.round() as i64
    }
}
