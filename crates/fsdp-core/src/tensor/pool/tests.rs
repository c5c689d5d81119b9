//! The pool's own tests: buckets by dtype, length and thread; the bound.

use super::*;
use crate::tensor::Tensor;

/// Free buffers the pool holds of this dtype and length.
fn free_of(dtype: DType, len: usize) -> usize {
    let key = (current_owner(), dtype, len);
    with_pool(|p| p.buckets.get(&key).map_or(0, |b| b.free.len()))
}

#[test]
fn buffers_of_every_host_dtype_come_back_by_dtype_and_length() {
    // Another test's last user dropping would empty the pool between a drop and a take.
    let _user = PoolUser::new();
    // A length no other test uses, so parallel tests do not take these buffers.
    let len = 12_347;
    let a = Tensor::zeros(&[len], DType::BF16);
    a.data_mut::<half::bf16>().unwrap().fill(half::bf16::ONE);
    drop(a);
    let b = Tensor::zeros(&[len], DType::F64);
    b.data_mut::<f64>().unwrap().fill(2.5);
    drop(b);
    assert_eq!(
        (free_of(DType::BF16, len), free_of(DType::F64, len)),
        (1, 1)
    );
    // Stale values for an op that overwrites them, zeros when asked.
    let a = Tensor::scratch(&[len], DType::BF16);
    assert!(a
        .data::<half::bf16>()
        .unwrap()
        .iter()
        .all(|x| *x == half::bf16::ONE));
    let b = Tensor::zeros(&[len], DType::F64);
    assert!(b.data::<f64>().unwrap().iter().all(|x| *x == 0.0));
    assert_eq!(
        (free_of(DType::BF16, len), free_of(DType::F64, len)),
        (0, 0)
    );
    // Another dtype of the same length is not served the bf16 buffer.
    drop(a);
    let c = Tensor::scratch(&[len], DType::F16);
    assert!(c
        .data::<half::f16>()
        .unwrap()
        .iter()
        .all(|x| *x == half::f16::ZERO));
    assert_eq!(free_of(DType::BF16, len), 1);
}

#[test]
fn the_pool_keeps_a_length_up_to_its_peak_and_only_when_asked_for() {
    let _user = PoolUser::new();
    let (len, other) = (12_377, 12_379);
    // Handed in, never asked for: not kept (a state dict's tensors).
    drop(Tensor::from_vec(vec![1.0f32; other], &[other]).unwrap());
    assert_eq!(free_of(DType::F32, other), 0);
    // Three at once: the peak is 3, and all three are kept.
    let three: Vec<Tensor> = (0..3).map(|_| Tensor::zeros(&[len], DType::F32)).collect();
    drop(three);
    assert_eq!(free_of(DType::F32, len), 3);
    // One handed in next to two from the pool: 3 live, the peak; dropped, the pool
    // holds 3 again, not 4 (one of them goes back to the allocator).
    let two: Vec<Tensor> = (0..2).map(|_| Tensor::zeros(&[len], DType::F32)).collect();
    let handed = Tensor::from_vec(vec![2.0f32; len], &[len]).unwrap();
    assert_eq!(free_of(DType::F32, len), 1);
    drop((two, handed));
    assert_eq!(free_of(DType::F32, len), 3);
    // Live bytes count every live buffer of a host dtype.
    let t = Tensor::zeros(&[len], DType::F32);
    assert!(memory_stats().active_bytes >= len * 4);
    drop(t);
    let before = memory_stats().pool_releases;
    empty_cache();
    assert_eq!(free_of(DType::F32, len), 0);
    assert!(memory_stats().pool_releases >= before + 3);
}

#[test]
fn a_buffer_goes_back_to_the_thread_that_made_it_and_leaves_with_it() {
    let _user = PoolUser::new();
    let len = 12_391;
    // Made here, dropped on another thread: back in this thread's bucket.
    let t = Tensor::zeros(&[len], DType::F32);
    std::thread::spawn(move || drop(t)).join().unwrap();
    assert_eq!(free_of(DType::F32, len), 1);
    // Another thread is not served it: its own bucket is empty, so it allocates, and
    // what it keeps is freed when it exits.
    let (misses, held) = std::thread::spawn(move || {
        let before = memory_stats().pool_misses;
        drop(Tensor::zeros(&[len], DType::F32));
        let misses = memory_stats().pool_misses - before;
        (misses, free_of(DType::F32, len))
    })
    .join()
    .unwrap();
    assert_eq!((misses, held), (1, 1));
    let other_owners = with_pool(|p| {
        p.buckets
            .keys()
            .filter(|k| (k.1, k.2) == (DType::F32, len) && k.0 != current_owner())
            .count()
    });
    assert_eq!(other_owners, 0, "the exited thread's bucket is gone");
    assert_eq!(free_of(DType::F32, len), 1, "this thread's is kept");
}

#[test]
fn the_limit_is_at_least_a_gib_and_can_be_set() {
    let default = pool_limit();
    assert!(default >= POOL_BYTES, "{default}");
    set_pool_limit(default + 4096);
    assert_eq!(pool_limit(), default + 4096);
    set_pool_limit(default);
    assert_eq!(pool_limit(), default);
}
