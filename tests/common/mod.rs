//! Helpers shared by the integration tests.
#![allow(dead_code)]

/// Asserts `|got - want| <= atol + rtol * |want|` elementwise; on failure prints the first
/// differing pairs, the max error and how much of the tolerance it used.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = (0.0f32, 0usize);
    let mut bad = Vec::new();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = atol + rtol * w.abs();
        let err = (g - w).abs();
        if err / tol.max(f32::MIN_POSITIVE) > worst.0 {
            worst = (err / tol.max(f32::MIN_POSITIVE), i);
        }
        if err.is_nan() || err > tol {
            bad.push((i, g, w));
        }
    }
    if !bad.is_empty() {
        panic!(
            "{what}: {} of {} elements differ (atol {atol}, rtol {rtol}); first: {:?}; worst at {} used {:.1}x the tolerance",
            bad.len(),
            got.len(),
            &bad[..bad.len().min(5)],
            worst.1,
            worst.0
        );
    }
}

/// Deterministic values in [-1, 1) from a seed (SplitMix64).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z =
                seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A text corpus of `n` bytes made of words drawn from a small vocabulary: learnable, so
/// losses fall, and needs no file from outside the repository.
pub fn corpus(n: usize) -> String {
    const WORDS: &[&str] = &[
        "the ", "king ", "and ", "queen ", "of ", "rome ", "shall ", "speak ", "to ", "me.\n",
        "my ", "lord, ",
    ];
    let v = values(99, n);
    let mut s = String::with_capacity(n + 8);
    let mut i = 0;
    while s.len() < n {
        let k = ((v[i % v.len()] + 1.0) * 6.0) as usize % WORDS.len();
        s.push_str(WORDS[k]);
        i += 1;
    }
    s.truncate(n);
    s
}
