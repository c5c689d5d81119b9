//! Collectives of the `threads` backend: `all_gather_into_tensor`, `reduce_scatter_tensor`
//! and `all_reduce` on f32 at 1 KiB - 64 MiB, 2 and 4 ranks, reported as bus bandwidth next to
//! this machine's memcpy bandwidth measured in the same run.
//!
//! Sizes and bandwidths follow nccl-tests (`doc/PERFORMANCE.md` there): `size` is the bytes
//! of the message per rank — the output of all-gather, the input of reduce-scatter, the
//! tensor of all-reduce; `algbw = size / time`; `busbw = algbw * (n-1)/n` for all-gather and
//! reduce-scatter and `algbw * 2(n-1)/n` for all-reduce. `memcpy` is one thread copying
//! `size` bytes from one buffer to another, counted the same way (bytes of the message, not
//! bytes read + written), so `busbw / memcpy` compares like with like.
//!
//! The ranks are threads spawned once per world size and kept alive; each measurement sends
//! them an iteration count and waits for all of them to finish (nothing is spawned or
//! allocated in the timed loop). Rank `r` is pinned to core `r % cores`, as nccl-tests binds
//! one GPU per rank: unpinned, the scheduler sometimes packs two ranks onto one core and,
//! since waiting ranks poll instead of sleeping, leaves them there, which halves the figures
//! for as long as it lasts (set `COLLECTIVES_PIN=0` to see it). After criterion's per-benchmark output the run prints its own
//! table (median of a few timed batches per case), including the in-place variants
//! (all-gather input = this rank's chunk of the output, reduce-scatter output = this rank's
//! chunk of the input) that nccl-tests reports beside the out-of-place ones.
//!
//! `cargo bench --bench collectives` (about two minutes on two cores);
//! `COLLECTIVES_TABLE=0` skips the table, `COLLECTIVES_CRITERION=0` skips criterion, and
//! `COLLECTIVES_ONLY` selects table rows (see [`selected`]); `COLLECTIVES_PIN=0` leaves
//! the rank threads unpinned.

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use fsdp::distributed::{ProcessGroup, ReduceOp, ThreadsGroup};
use fsdp::tensor::{DType, Tensor};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::{Duration, Instant};

const SIZES: [usize; 5] = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];
const WORLDS: [usize; 2] = [2, 4];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather_into_tensor",
            Op::ReduceScatter => "reduce_scatter_tensor",
            Op::AllReduce => "all_reduce",
        }
    }

    /// nccl-tests' bus bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
            Op::AllReduce => 2.0 * (n - 1.0) / n,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    op: Op,
    /// Message bytes per rank (nccl-tests' `size`).
    bytes: usize,
    in_place: bool,
}

enum Cmd {
    Setup(Case),
    Run(u64),
}

/// `n` rank threads that live for the whole run, driven over channels.
struct World {
    n: usize,
    cmds: Vec<Sender<Cmd>>,
    done: Receiver<Result<(), String>>,
}

/// One rank's tensors for the current case.
struct Bufs {
    case: Case,
    a: Tensor,
    b: Tensor,
}

fn setup(pg: &ThreadsGroup, case: Case) -> fsdp::Result<Bufs> {
    let n = pg.size();
    let elems = case.bytes / 4;
    let fill = |t: &Tensor| -> fsdp::Result<()> {
        let mut d = t.f32_mut()?;
        for (i, v) in d.iter_mut().enumerate() {
            *v = ((i * 7 + pg.rank()) % 13) as f32 * 0.25;
        }
        Ok(())
    };
    // a: the tensor written, b: the tensor read (the same for all-reduce).
    let (a, b) = match case.op {
        Op::AllGather => {
            let out = Tensor::zeros(&[elems], DType::F32);
            let inp = if case.in_place {
                out.view(pg.rank() * (elems / n), &[elems / n])?
            } else {
                Tensor::zeros(&[elems / n], DType::F32)
            };
            (out, inp)
        }
        Op::ReduceScatter => {
            let inp = Tensor::zeros(&[elems], DType::F32);
            let out = if case.in_place {
                inp.view(pg.rank() * (elems / n), &[elems / n])?
            } else {
                Tensor::zeros(&[elems / n], DType::F32)
            };
            (out, inp)
        }
        Op::AllReduce => {
            let t = Tensor::zeros(&[elems], DType::F32);
            (t.clone(), t)
        }
    };
    fill(&b)?;
    let bufs = Bufs { case, a, b };
    run_once(pg, &bufs)?; // first touch of every page, outside the timing
    Ok(bufs)
}

fn run_once(pg: &ThreadsGroup, bufs: &Bufs) -> fsdp::Result<()> {
    match bufs.case.op {
        Op::AllGather => pg.all_gather_into_tensor(&bufs.a, &bufs.b),
        Op::ReduceScatter => pg.reduce_scatter_tensor(&bufs.a, &bufs.b, ReduceOp::Sum),
        // Avg keeps values bounded over many iterations.
        Op::AllReduce => pg.all_reduce(&bufs.a, ReduceOp::Avg),
    }
}

impl World {
    fn new(n: usize) -> World {
        let groups = ThreadsGroup::new_world(n, Duration::from_secs(120)).expect("world");
        let (done_tx, done) = channel();
        let mut cmds = Vec::new();
        for pg in groups {
            let (tx, rx) = channel::<Cmd>();
            cmds.push(tx);
            let done_tx = done_tx.clone();
            std::thread::Builder::new()
                .name(format!("rank{}", pg.rank()))
                .spawn(move || {
                    if on("COLLECTIVES_PIN") {
                        pin_to_core(pg.rank());
                    }
                    let mut bufs: Option<Bufs> = None;
                    while let Ok(cmd) = rx.recv() {
                        let res = match cmd {
                            Cmd::Setup(case) => {
                                bufs = None; // free the previous case's memory first
                                setup(&pg, case).map(|b| bufs = Some(b))
                            }
                            Cmd::Run(iters) => match &bufs {
                                Some(b) => (0..iters).try_for_each(|_| run_once(&pg, b)),
                                None => Ok(()),
                            },
                        };
                        if done_tx.send(res.map_err(|e| e.to_string())).is_err() {
                            break;
                        }
                    }
                })
                .expect("spawn rank");
        }
        World { n, cmds, done }
    }

    fn all(&self, cmd: impl Fn() -> Cmd) {
        for tx in &self.cmds {
            tx.send(cmd()).expect("rank thread alive");
        }
        for _ in 0..self.n {
            if let Err(e) = self.done.recv().expect("rank thread alive") {
                panic!("collective failed: {e}");
            }
        }
    }

    fn setup(&self, case: Case) {
        self.all(|| Cmd::Setup(case));
    }

    /// Wall time of `iters` collectives on every rank.
    fn run(&self, iters: u64) -> Duration {
        let t0 = Instant::now();
        self.all(|| Cmd::Run(iters));
        t0.elapsed()
    }
}

/// Pins this thread to core `i % cores` (Linux; elsewhere a no-op).
fn pin_to_core(i: usize) {
    #[cfg(target_os = "linux")]
    {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: `set` is a zeroed, then filled cpu_set_t that outlives the call; pid 0 is
        // the calling thread.
        let res = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(i % cores, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        if res != 0 {
            eprintln!(
                "could not pin rank {i}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = i;
}

/// True unless the environment variable is set to `0`.
fn on(var: &str) -> bool {
    std::env::var(var).map(|v| v != "0").unwrap_or(true)
}

/// Median seconds per iteration of `f(iters)` over a few batches of about 30 ms.
fn median_secs(mut f: impl FnMut(u64) -> Duration) -> f64 {
    let once = f(1).as_secs_f64().max(1e-7);
    let iters = ((0.03 / once) as u64).clamp(1, 200_000);
    let mut samples: Vec<f64> = (0..7)
        .map(|_| f(iters).as_secs_f64() / iters as f64)
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Seconds per copy of `bytes` bytes between two buffers on this thread.
fn memcpy_secs(bytes: usize) -> f64 {
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    median_secs(|iters| {
        let t0 = Instant::now();
        for _ in 0..iters {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        t0.elapsed()
    })
}

fn size_label(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

fn criterion_benches(c: &mut Criterion, worlds: &[(usize, World)]) {
    for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
        let mut g = c.benchmark_group(op.name());
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_millis(600))
            .sampling_mode(SamplingMode::Flat);
        for (n, world) in worlds {
            for bytes in SIZES {
                let case = Case {
                    op,
                    bytes,
                    in_place: false,
                };
                world.setup(case);
                g.throughput(Throughput::Bytes(bytes as u64));
                g.bench_function(
                    BenchmarkId::new(format!("{n}ranks"), size_label(bytes)),
                    |b| b.iter_custom(|iters| world.run(iters)),
                );
            }
        }
        g.finish();
    }
}

/// `COLLECTIVES_ONLY=all_gather,4` (comma-separated words, all of which must occur in
/// `"{op} {ranks}ranks {size} in-place|out-of-place"`) limits the table to matching cases.
fn selected(case: Case, n: usize) -> bool {
    let key = format!(
        "{} {n}ranks {} {}",
        case.op.name(),
        size_label(case.bytes),
        if case.in_place {
            "in-place"
        } else {
            "out-of-place"
        }
    );
    std::env::var("COLLECTIVES_ONLY")
        .map(|f| f.split(',').all(|w| key.contains(w.trim())))
        .unwrap_or(true)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "n/a".into())
}

fn table(worlds: &[(usize, World)]) {
    // Warm up (clock, caches, the ranks' threads) before the first row.
    for (_, world) in worlds {
        world.setup(Case {
            op: Op::AllReduce,
            bytes: 64 << 10,
            in_place: false,
        });
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(150) {
            world.run(100);
        }
    }
    let load_before = loadavg();
    let memcpy: Vec<(usize, f64)> = SIZES.iter().map(|&b| (b, memcpy_secs(b))).collect();
    println!();
    println!("threads backend collectives, f32; GB = 1e9 bytes; size = message bytes per rank");
    println!("memcpy: one thread copying `size` bytes (bytes of the message, as algbw counts)");
    println!(
        "{:>6} {:>5} {:<34} {:>10} {:>8} {:>8} {:>8} {:>8}",
        "size", "ranks", "op", "time(us)", "algbw", "busbw", "memcpy", "bus/mcp"
    );
    for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
        for (n, world) in worlds {
            for in_place in [false, true] {
                if in_place && op == Op::AllReduce {
                    continue; // all_reduce is always in place
                }
                for &(bytes, mcp_s) in &memcpy {
                    let case = Case {
                        op,
                        bytes,
                        in_place,
                    };
                    if !selected(case, *n) {
                        continue;
                    }
                    world.setup(case);
                    let t = median_secs(|iters| world.run(iters));
                    let algbw = bytes as f64 / t / 1e9;
                    let busbw = algbw * op.bus_factor(*n);
                    let mcp = bytes as f64 / mcp_s / 1e9;
                    let name = if in_place {
                        format!("{} (in-place)", op.name())
                    } else {
                        op.name().to_string()
                    };
                    println!(
                        "{:>6} {:>5} {:<34} {:>10.1} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                        size_label(bytes),
                        n,
                        name,
                        t * 1e6,
                        algbw,
                        busbw,
                        mcp,
                        busbw / mcp
                    );
                }
            }
        }
    }
    // Other processes on the machine show up as noise in these figures.
    println!(
        "load average (1, 5, 15 min) before: {load_before}, after: {}",
        loadavg()
    );
}

fn main() {
    let test_mode = std::env::args().any(|a| a == "--test");
    let worlds: Vec<(usize, World)> = WORLDS.iter().map(|&n| (n, World::new(n))).collect();
    if on("COLLECTIVES_CRITERION") {
        let mut c = Criterion::default().configure_from_args();
        criterion_benches(&mut c, &worlds);
        c.final_summary();
    }
    if on("COLLECTIVES_TABLE") && !test_mode {
        table(&worlds);
    }
}
