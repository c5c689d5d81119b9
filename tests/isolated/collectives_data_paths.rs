//! The threads backend's data paths (see `fsdp::distributed::threads`): results bit-identical
//! to a sequential f64 reference at sizes that cross the reduction chunks and split unevenly
//! across ranks, in-place and aliased tensors, and no allocation per collective once a group
//! is warm (counted by a global allocator).

use fsdp::distributed::{launch, Group, LaunchOptions, ReduceOp};
use fsdp::tensor::{DType, Element, Tensor};
use half::{bf16, f16};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

/// Counts allocations per thread (so the test harness and other tests do not interfere).
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards to the system allocator unchanged; the counter is a const-initialized
// thread-local without a destructor, so touching it allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

/// Values over many binades and both signs, so that the order and precision of the
/// accumulation show in the rounded results.
fn values<T: Element>(seed: u64, n: usize) -> Vec<T> {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            let mant = (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let scale = if T::DTYPE == DType::I32 {
                1e4
            } else {
                2f32.powi(((z >> 8) % 16) as i32 - 8)
            };
            T::from_f32(mant * scale)
        })
        .collect()
}

/// The sequential reference: widen to f64, combine in rank order, divide for Avg, round once.
fn reduce_ref<T: Element>(op: ReduceOp, per_rank: &[Vec<T>], i: usize) -> T {
    let mut acc = per_rank[0][i].to_f64();
    for v in &per_rank[1..] {
        let x = v[i].to_f64();
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + x,
            ReduceOp::Max => acc.max(x),
            ReduceOp::Min => acc.min(x),
            ReduceOp::Product => acc * x,
        };
    }
    if op == ReduceOp::Avg {
        acc /= per_rank.len() as f64;
    }
    T::from_f64(acc)
}

fn bits<T: Element>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn read<T: Element>(t: &Tensor) -> Vec<T> {
    t.data::<T>().unwrap().to_vec()
}

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

fn check_dtype<T: Element>() {
    // 4099: several reduction chunks, no world size divides it; 1: a single element that
    // lands in one rank's all-reduce range; 0: empty.
    for world in 1..=5 {
        for n in [0usize, 1, 4099] {
            let inputs: Vec<Vec<T>> = (0..world).map(|r| values(r as u64 + 1, n)).collect();
            let big: Vec<Vec<T>> = (0..world)
                .map(|r| values(r as u64 + 11, n * world))
                .collect();
            let out = launch(&LaunchOptions::new(world), |pg| {
                let r = pg.rank();
                let mut reduced = Vec::new();
                for op in OPS {
                    let t = Tensor::from_vec(inputs[r].clone(), &[n])?;
                    pg.all_reduce(&t, op)?;
                    reduced.push(read::<T>(&t));
                }
                // reduce-scatter, out of place and in place (output = chunk r of the input)
                let inp = Tensor::from_vec(big[r].clone(), &[n * world])?;
                let shard = Tensor::zeros(&[n], T::DTYPE);
                pg.reduce_scatter_tensor(&shard, &inp, ReduceOp::Avg)?;
                let whole = Tensor::from_vec(big[r].clone(), &[n * world])?;
                let mine = whole.view(r * n, &[n])?;
                pg.reduce_scatter_tensor(&mine, &whole, ReduceOp::Sum)?;
                // all-gather, in place (input = chunk r of the output)
                let full = Tensor::zeros(&[n * world], T::DTYPE);
                full.view(r * n, &[n])?
                    .data_mut::<T>()?
                    .copy_from_slice(&inputs[r]);
                pg.all_gather_into_tensor(&full, &full.view(r * n, &[n])?)?;
                // broadcast from the last rank
                let b = Tensor::from_vec(inputs[r].clone(), &[n])?;
                pg.broadcast(&b, world - 1)?;
                Ok((
                    reduced,
                    read::<T>(&shard),
                    read::<T>(&mine),
                    read::<T>(&full),
                    read::<T>(&b),
                ))
            })
            .unwrap();
            let what = |s: &str| format!("{s}: {} world {world} n {n}", T::DTYPE);
            let chunks: Vec<Vec<Vec<T>>> = (0..world)
                .map(|r| big.iter().map(|b| b[r * n..(r + 1) * n].to_vec()).collect())
                .collect();
            let gathered: Vec<T> = inputs.concat();
            for (r, (reduced, shard, mine, full, b)) in out.iter().enumerate() {
                for (op, got) in OPS.iter().zip(reduced) {
                    let want: Vec<T> = (0..n).map(|i| reduce_ref(*op, &inputs, i)).collect();
                    assert_eq!(bits(got), bits(&want), "{} {op:?}", what("all_reduce"));
                }
                let want: Vec<T> = (0..n)
                    .map(|i| reduce_ref(ReduceOp::Avg, &chunks[r], i))
                    .collect();
                assert_eq!(bits(shard), bits(&want), "{}", what("reduce_scatter"));
                let want: Vec<T> = (0..n)
                    .map(|i| reduce_ref(ReduceOp::Sum, &chunks[r], i))
                    .collect();
                assert_eq!(
                    bits(mine),
                    bits(&want),
                    "{}",
                    what("in-place reduce_scatter")
                );
                assert_eq!(
                    bits(full),
                    bits(&gathered),
                    "{}",
                    what("in-place all_gather")
                );
                assert_eq!(bits(b), bits(&inputs[world - 1]), "{}", what("broadcast"));
            }
        }
    }
}

#[test]
fn results_are_bit_identical_to_a_sequential_f64_reference() {
    check_dtype::<f32>();
    check_dtype::<bf16>();
    check_dtype::<f16>();
    check_dtype::<i32>();
}

#[test]
fn a_large_separate_reduce_scatter_output_matches_the_reference() {
    // 16 MiB + 12 bytes of f32 output per rank: written with non-temporal stores, from an
    // odd address offset (a view one element in).
    let m = (4 << 20) + 3;
    let world = 2;
    let inputs: Vec<Vec<f32>> = (0..world)
        .map(|r| values(r as u64 + 3, m * world))
        .collect();
    let out = launch(&LaunchOptions::new(world), |pg| {
        let inp = Tensor::from_vec(inputs[pg.rank()].clone(), &[m * world])?;
        let buf = Tensor::zeros(&[m + 1], DType::F32);
        pg.reduce_scatter_tensor(&buf.view(1, &[m])?, &inp, ReduceOp::Sum)?;
        Ok(read::<f32>(&buf))
    })
    .unwrap();
    for (r, got) in out.iter().enumerate() {
        let chunks: Vec<Vec<f32>> = inputs
            .iter()
            .map(|v| v[r * m..(r + 1) * m].to_vec())
            .collect();
        let want: Vec<f32> = (0..m)
            .map(|i| reduce_ref(ReduceOp::Sum, &chunks, i))
            .collect();
        assert_eq!(
            got[0], 0.0,
            "rank {r}: the element before the view is untouched"
        );
        assert!(
            bits(&got[1..]) == bits(&want),
            "rank {r}: reduce_scatter differs"
        );
    }
}

#[test]
fn an_input_that_overlaps_the_output_elsewhere_is_read_from_a_copy() {
    // Every rank passes chunk 0 of its output as its input (in place only for rank 0), and
    // a reduce-scatter output that is chunk 0 of the input.
    let out = launch(&LaunchOptions::new(3), |pg| {
        let r = pg.rank() as f32;
        let full = Tensor::zeros(&[6], DType::F32);
        full.f32_mut()?[..2].copy_from_slice(&[r, r + 0.5]);
        pg.all_gather_into_tensor(&full, &full.view(0, &[2])?)?;
        let inp = Tensor::from_vec((0..6).map(|i| i as f32 + r).collect(), &[6])?;
        pg.reduce_scatter_tensor(&inp.view(0, &[2])?, &inp, ReduceOp::Sum)?;
        Ok((full.to_vec_f32()?, inp.to_vec_f32()?[..2].to_vec()))
    })
    .unwrap();
    for (r, (full, shard)) in out.iter().enumerate() {
        assert_eq!(full, &vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        // chunk r of (0..6) + rank, summed over ranks 0, 1, 2
        let want: Vec<f32> = (0..2).map(|j| 3.0 * (2 * r + j) as f32 + 3.0).collect();
        assert_eq!(shard, &want, "rank {r}");
    }
}

/// Every collective of the backend once on `pg`, reusing the given tensors (views made
/// beforehand: making a view allocates its shape).
fn every_collective(pg: &Group, t: &[Tensor; 8]) -> fsdp::Result<()> {
    let [full, local, full_mine, big, shard, big_mine, red, bf] = t;
    pg.all_gather_into_tensor(full, local)?;
    pg.all_gather_into_tensor(full, full_mine)?;
    pg.reduce_scatter_tensor(shard, big, ReduceOp::Sum)?;
    pg.reduce_scatter_tensor(big_mine, big, ReduceOp::Avg)?;
    for op in OPS {
        pg.all_reduce(red, op)?;
    }
    pg.all_reduce(bf, ReduceOp::Avg)?;
    pg.broadcast(red, pg.size() - 1)?;
    pg.barrier()
}

#[test]
fn collectives_allocate_nothing_once_warm() {
    for world in [1, 2, 4] {
        let per_rank = launch(&LaunchOptions::new(world), |pg| {
            let n = 3000; // several reduction chunks
            let r = pg.rank();
            let full = Tensor::zeros(&[n * world], DType::F32);
            let big = Tensor::from_vec(values::<f32>(r as u64 + 9, n * world), &[n * world])?;
            let t = [
                full.clone(),
                Tensor::from_vec(values::<f32>(r as u64, n), &[n])?,
                full.view(r * n, &[n])?,
                big.clone(),
                Tensor::zeros(&[n], DType::F32),
                big.view(r * n, &[n])?,
                Tensor::from_vec(values::<f32>(r as u64 + 5, n), &[n])?,
                Tensor::from_vec(values::<bf16>(r as u64 + 7, n), &[n])?,
            ];
            // Warm up, and make every rank sleep in a wait at least once (a thread's first
            // sleep sets up its parking slot), while each rank in turn is late.
            every_collective(&pg, &t)?;
            for late in 0..world {
                if late == r {
                    std::thread::sleep(Duration::from_millis(80));
                }
                pg.barrier()?;
            }
            every_collective(&pg, &t)?;
            let before = allocs();
            for _ in 0..20 {
                every_collective(&pg, &t)?;
            }
            Ok(allocs() - before)
        })
        .unwrap();
        assert!(
            per_rank.iter().all(|&a| a == 0),
            "world {world}: allocations per rank over 20 rounds of every collective: {per_rank:?}"
        );
    }
}
