//! Wider vectors for the reference loops, chosen at run time.
//!
//! The crate is built for baseline x86-64 (SSE2), so a loop that the compiler vectorizes
//! gets 4-wide vectors. `multiversion!` compiles a function's body three times, for
//! AVX-512, for AVX2 and for the baseline, and runs the widest the CPU supports (checked
//! once per process by the standard library's cached feature detection).
//!
//! The three copies compute the same bits: Rust never contracts `a * b + c` into a fused
//! multiply-add (that needs an explicit `mul_add`), and every other float operation the
//! loops use (+, -, *, /, sqrt, min, max, copysign, bit casts) is correctly rounded or
//! exact on every instruction set. `tests` check this on the nn loops.

/// Defines `fn $name` whose body is compiled for AVX-512, AVX2 and the baseline, running
/// the widest the CPU has. The body must be safe code; the function has the same
/// signature (no generics, no `self`). Crate-internal, public only for the layers above
/// (`#[macro_export]` puts it at the crate root too; name it as
/// `backend::cpu::simd::multiversion`).
#[doc(hidden)]
#[macro_export]
macro_rules! multiversion {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                /// The body with AVX-512 (F, VL, BW, DQ), AVX2 and FMA enabled.
                ///
                /// # Safety
                /// The CPU must have those features.
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                /// The body with AVX2 and FMA enabled.
                ///
                /// # Safety
                /// The CPU must have those features.
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if $crate::backend::cpu::simd::has_avx512() {
                    // SAFETY: the CPU has every feature v4 enables (checked just above).
                    return unsafe { v4($($arg),*) };
                }
                if $crate::backend::cpu::simd::has_avx2() {
                    // SAFETY: the CPU has every feature v3 enables (checked just above).
                    return unsafe { v3($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
#[doc(hidden)] // crate-internal, public only for the layers above
pub use multiversion;

/// The widest copy this CPU runs: 4 (AVX-512 F, VL, BW, DQ with AVX2 and FMA), 3 (AVX2
/// and FMA) or 0 (baseline); detected once per process.
#[cfg(target_arch = "x86_64")]
fn level() -> u8 {
    use std::arch::is_x86_feature_detected as has;
    static LEVEL: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let v3 = has!("avx2") && has!("fma");
        let v4 = v3 && has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq");
        if v4 {
            4
        } else if v3 {
            3
        } else {
            0
        }
    })
}

/// True when the CPU runs the AVX-512 copies (F, VL, BW, DQ, with AVX2 and FMA).
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn has_avx512() -> bool {
    level() == 4
}

/// True when the CPU runs the AVX2 copies (AVX2 and FMA).
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn has_avx2() -> bool {
    level() >= 3
}
