//! The `nccl` backend with several ranks: thread ranks of this process, one communicator
//! each, as a torchrun script with one GPU per rank would have them. On cuda-emu
//! (`scripts/cuda-emu.sh`) every world size runs, ranks sharing the emulated devices; on a
//! machine with fewer GPUs than ranks real NCCL refuses two ranks on one device, so the test
//! says so and stops. Collectives must be exact (the emulator reduces in rank order in f64,
//! as the threads backend does), and every fault must end every rank promptly with an error
//! that names the rank at fault: a rank that never arrives (Timeout), a rank that failed
//! (PeerFailed), ranks that called different collectives.

use fsdp::distributed::nccl::{self, NcclGroup};
use fsdp::distributed::{ProcessGroup, ReduceOp, Store, TcpStore};
use fsdp::tensor::{DType, Tensor};
use fsdp::Error;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The group timeout of the fault cases.
const TIMEOUT: Duration = Duration::from_secs(2);

/// Whether `world` thread ranks can each have a communicator on a device of their own here
/// (NCCL refuses two ranks of one communicator on one GPU, and a device-wide synchronization
/// such as `cuMemFree` would wait for a peer's collective that waits for this rank:
/// `scripts/cuda-emu.sh` runs these tests with 4 emulated devices). Prints why not.
fn can_run(world: usize) -> bool {
    if !nccl::is_available() {
        eprintln!("NCCL world of {world} not run: no libnccl");
        return false;
    }
    match fsdp::backend::cuda::detect() {
        Ok(gpus) if gpus.len() >= world => true,
        Ok(gpus) => {
            eprintln!(
                "skipping an NCCL world of {world} thread ranks on {} device(s): one GPU per rank needed",
                gpus.len()
            );
            false
        }
        Err(e) => {
            eprintln!("NCCL world of {world} not run: {e}");
            false
        }
    }
}

/// Runs `f` on `world` thread ranks, each with its own NCCL world group (store hosted by
/// rank 0, device `rank % devices`), and returns every rank's result and the wall time.
fn world_of<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(&NcclGroup) -> fsdp::Result<R> + Sync,
) -> (Vec<fsdp::Result<R>>, Duration) {
    let devices = fsdp::backend::cuda::detect().map_or(1, |g| g.len().max(1));
    let (port_tx, port_rx) = mpsc::channel::<u16>();
    let port_rx = std::sync::Mutex::new(port_rx);
    let ports = std::sync::Mutex::new(None::<u16>);
    let start = Instant::now();
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (f, port_tx, port_rx, ports) = (&f, port_tx.clone(), &port_rx, &ports);
                s.spawn(move || -> fsdp::Result<R> {
                    let store: Arc<dyn Store> = if rank == 0 {
                        let st = TcpStore::new("127.0.0.1", 0, 0, true, Duration::from_secs(10))?;
                        for _ in 1..world {
                            let _ = port_tx.send(st.port());
                        }
                        Arc::new(st)
                    } else {
                        let port = {
                            let mut p = ports.lock().unwrap();
                            *p.get_or_insert_with(|| port_rx.lock().unwrap().recv().unwrap())
                        };
                        Arc::new(TcpStore::new(
                            "127.0.0.1",
                            port,
                            rank,
                            false,
                            Duration::from_secs(10),
                        )?)
                    };
                    let g = NcclGroup::new(rank, world, rank % devices, store, timeout)?;
                    f(&g)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect::<Vec<_>>()
    });
    (out, start.elapsed())
}

/// Rank `r`'s exact values: multiples of 1/8 in [-1, 1) (integers in [-8, 8) for i32),
/// exact in every dtype, and so are their sums over a few ranks.
fn values_of(r: usize, n: usize, dtype: DType) -> Vec<f32> {
    let scale = if dtype == DType::I32 { 1.0 } else { 8.0 };
    (0..n)
        .map(|i| (((i * 7 + r * 13) % 17) as f32 - 8.0) / scale)
        .collect()
}

fn values(r: usize, n: usize) -> Vec<f32> {
    values_of(r, n, DType::F32)
}

fn on_device(g: &NcclGroup, v: &[f32], dtype: DType) -> fsdp::Result<Tensor> {
    Tensor::from_vec(v.to_vec(), &[v.len()])?
        .to_dtype(dtype)?
        .to_device(g.device())
}

#[test]
fn nccl_thread_ranks_move_and_reduce_exactly() {
    for world in [2usize, 4] {
        if !can_run(world) {
            continue;
        }
        let n = 6;
        let (results, _) = world_of(world, Duration::from_secs(30), |g| {
            let r = g.rank();
            for dtype in [DType::F32, DType::BF16, DType::I32, DType::F64] {
                let values = |p: usize, n: usize| values_of(p, n, dtype);
                let mine = values(r, n);
                let x = on_device(g, &mine, dtype)?;
                // all-gather: every rank's values in rank order.
                let all = Tensor::zeros_on(&[n * world], dtype, g.device())?;
                g.all_gather_into_tensor(&all, &x)?;
                let want: Vec<f32> = (0..world).flat_map(|p| values(p, n)).collect();
                assert_eq!(all.to_vec_f32()?, want, "all_gather {dtype} world {world}");
                // reduce-scatter: this rank's chunk of the sum of everyone's buffers.
                let big: Vec<f32> = (0..n * world).map(|i| values(r, n * world)[i]).collect();
                let input = on_device(g, &big, dtype)?;
                let out = Tensor::zeros_on(&[n], dtype, g.device())?;
                g.reduce_scatter_tensor(&out, &input, ReduceOp::Sum)?;
                let want: Vec<f32> = (0..n)
                    .map(|i| (0..world).map(|p| values(p, n * world)[r * n + i]).sum())
                    .collect();
                assert_eq!(
                    out.to_vec_f32()?,
                    want,
                    "reduce_scatter {dtype} world {world}"
                );
                // all-reduce max, then broadcast from the last rank.
                let y = on_device(g, &mine, dtype)?;
                g.all_reduce(&y, ReduceOp::Max)?;
                let want: Vec<f32> = (0..n)
                    .map(|i| (0..world).map(|p| values(p, n)[i]).fold(f32::MIN, f32::max))
                    .collect();
                assert_eq!(
                    y.to_vec_f32()?,
                    want,
                    "all_reduce max {dtype} world {world}"
                );
                let z = on_device(g, &mine, dtype)?;
                g.broadcast(&z, world - 1)?;
                assert_eq!(z.to_vec_f32()?, values(world - 1, n), "broadcast {dtype}");
            }
            g.barrier()?;
            Ok(())
        });
        for (r, res) in results.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("world {world}, rank {r}: {e}"));
        }
    }
}

/// The error of every rank that failed, or a panic naming one that did not.
fn errors(results: Vec<fsdp::Result<()>>, ranks: &[usize]) -> Vec<Error> {
    let mut out = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Err(e) => out.push(e),
            Ok(()) if ranks.contains(&r) => panic!("rank {r} ended without an error"),
            Ok(()) => {}
        }
    }
    out
}

#[test]
fn nccl_a_rank_that_never_arrives_is_named_by_every_peer() {
    if !can_run(3) {
        return;
    }
    let (results, took) = world_of(3, TIMEOUT, |g| {
        let t = on_device(g, &values(g.rank(), 4), DType::F32)?;
        g.all_reduce(&t, ReduceOp::Sum)?;
        if g.rank() == 2 {
            // Skips the second collective, staying alive until the others gave up.
            std::thread::sleep(TIMEOUT * 2);
            return Ok(());
        }
        // The collective returns once queued; the barrier waits on the host and reports
        // what the watchdog found.
        g.all_reduce(&t, ReduceOp::Sum)?;
        g.barrier()
    });
    for e in errors(results, &[0, 1]) {
        match &e {
            Error::Timeout { missing_ranks, .. } => assert_eq!(missing_ranks, &vec![2], "{e}"),
            other => panic!("expected a Timeout naming rank 2, got: {other}"),
        }
    }
    assert!(took < TIMEOUT * 4, "took {took:?}");
}

#[test]
fn nccl_a_failed_rank_is_named_by_every_peer_within_seconds() {
    if !can_run(3) {
        return;
    }
    let (results, took) = world_of(3, Duration::from_secs(20), |g| {
        let t = on_device(g, &values(g.rank(), 4), DType::F32)?;
        g.all_reduce(&t, ReduceOp::Sum)?;
        if g.rank() == 1 {
            // What launch does for a rank whose code returned an error.
            g.abort("rank 1 failed: out of data");
            return Err(Error::Fsdp("out of data".into()));
        }
        g.all_reduce(&t, ReduceOp::Sum)?;
        g.barrier()
    });
    let errs = errors(results, &[0, 1, 2]);
    assert_eq!(errs.len(), 3);
    let mut named = 0;
    for e in &errs[..] {
        if let Error::PeerFailed {
            failed_rank,
            reason,
        } = e
        {
            assert_eq!(*failed_rank, 1, "{e}");
            assert!(reason.contains("out of data"), "{e}");
            named += 1;
        }
    }
    assert_eq!(named, 2, "both peers name rank 1: {errs:?}");
    assert!(
        took < Duration::from_secs(10),
        "took {took:?}: the peers waited for the timeout"
    );
}

#[test]
fn nccl_ranks_that_call_different_collectives_fail_promptly() {
    if !can_run(2) {
        return;
    }
    let (results, took) = world_of(2, Duration::from_secs(20), |g| {
        let t = on_device(g, &values(g.rank(), 4), DType::F32)?;
        if g.rank() == 0 {
            g.all_reduce(&t, ReduceOp::Sum)?;
        } else {
            g.broadcast(&t, 0)?;
        }
        g.barrier()
    });
    for e in errors(results, &[0, 1]) {
        let s = e.to_string();
        assert!(s.contains("mismatched collectives"), "{s}");
        assert!(
            s.contains("ncclAllReduce") && s.contains("ncclBroadcast"),
            "{s}"
        );
    }
    assert!(took < Duration::from_secs(10), "took {took:?}");
}
