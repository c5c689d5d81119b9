//! FSDP's per-rank streams (src/fsdp/streams.rs): all-gathers run on the unshard stream,
//! gradient reductions on the post-backward stream over a second communicator of the same
//! ranks, and with a group that cannot make one the reductions fall back to the unshard
//! stream. Every variant trains to the same parameters as unsharded training.

use crate::common;
use common::named_values as params;

use common::assert_close;
use fsdp::distributed::{launch, Group, LaunchOptions, ProcessGroup, ReduceOp};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, CpuOffload, FsdpConfig, FullyShardedDataParallel,
    ShardingStrategy,
};
use fsdp::nn::Module;
use fsdp::optim::Optimizer;
use fsdp::tensor::Tensor;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// One collective as a rank ran it: which op, on which thread, over which group.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    op: &'static str,
    thread: String,
    group: usize,
}

/// A process group that records every collective and passes it on; `new_group` wraps the
/// inner group's new group (when `dup` is on) so its calls are recorded too.
struct Recording {
    inner: Group,
    id: usize,
    next_id: Arc<AtomicUsize>,
    log: Arc<Mutex<Vec<Call>>>,
    dup: bool,
}

impl Recording {
    fn record(&self, op: &'static str) {
        let thread = std::thread::current().name().unwrap_or("?").to_string();
        self.log.lock().unwrap().push(Call {
            op,
            thread,
            group: self.id,
        });
    }
}

impl ProcessGroup for Recording {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn backend(&self) -> &'static str {
        "recording"
    }
    fn world_rank(&self) -> usize {
        self.inner.world_rank()
    }
    fn ranks(&self) -> Vec<usize> {
        self.inner.ranks()
    }
    fn new_group(&self, ranks: &[usize]) -> fsdp::Result<Option<Group>> {
        if !self.dup {
            return Err(fsdp::Error::Unsupported("new_group on recording".into()));
        }
        Ok(self.inner.new_group(ranks)?.map(|g| {
            Arc::new(Recording {
                inner: g,
                id: self.next_id.fetch_add(1, Ordering::SeqCst),
                next_id: self.next_id.clone(),
                log: self.log.clone(),
                dup: true,
            }) as Group
        }))
    }
    fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> fsdp::Result<()> {
        self.record("all_gather");
        self.inner.all_gather_into_tensor(output, input)
    }
    fn reduce_scatter_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> fsdp::Result<()> {
        self.record("reduce_scatter");
        self.inner.reduce_scatter_tensor(output, input, op)
    }
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> fsdp::Result<()> {
        self.record("all_reduce");
        self.inner.all_reduce(tensor, op)
    }
    fn broadcast(&self, tensor: &Tensor, src: usize) -> fsdp::Result<()> {
        self.record("broadcast");
        self.inner.broadcast(tensor, src)
    }
    fn barrier(&self) -> fsdp::Result<()> {
        self.record("barrier");
        self.inner.barrier()
    }
}

const WORLD: usize = 2;
const ROWS: usize = 8;
const STEPS: usize = 3;

fn step(m: &mut dyn Module, step: usize, lo: usize, hi: usize) -> fsdp::Result<()> {
    common::gpt_step(m, step, lo, hi)
}

/// Full parameters by name.
type Params = Vec<(String, Vec<f32>)>;

/// Trains the small GPT (one unit per block) on `WORLD` recording ranks; returns rank 0's
/// full parameters and every rank's calls.
fn train(dup: bool, strategy: ShardingStrategy, offload: bool) -> (Params, Vec<Vec<Call>>) {
    let out = launch(&LaunchOptions::new(WORLD), |pg| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let rec: Group = Arc::new(Recording {
            inner: pg.clone(),
            id: 0,
            next_id: Arc::new(AtomicUsize::new(1)),
            log: log.clone(),
            dup,
        });
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
            cpu_offload: CpuOffload {
                offload_params: offload,
            },
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(common::small_gpt(2), rec, cfg)?;
        let mut opt = common::sgd(0.1);
        let rows = ROWS / WORLD;
        for s in 0..STEPS {
            step(&mut m, s, pg.rank() * rows, (pg.rank() + 1) * rows)?;
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        let calls = log.lock().unwrap().clone();
        Ok((m.full_parameters()?, calls))
    })
    .unwrap();
    let full = out[0].0.clone();
    (full, out.into_iter().map(|(_, c)| c).collect())
}

fn reference() -> Vec<(String, Vec<f32>)> {
    let mut m = common::small_gpt(2);
    let mut opt = common::sgd(0.1);
    for s in 0..STEPS {
        step(m.as_mut(), s, 0, ROWS).unwrap();
        opt.step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        fsdp::nn::zero_grad(m.as_mut());
    }
    params(m.as_mut())
}

fn assert_matches(what: &str, got: &[(String, Vec<f32>)], want: &[(String, Vec<f32>)]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for ((n, g), (_, w)) in got.iter().zip(want) {
        assert_close(&format!("{what} {n}"), g, w, 1e-5, 1e-4);
    }
}

fn of<'a>(calls: &'a [Call], op: &str) -> Vec<&'a Call> {
    calls.iter().filter(|c| c.op == op).collect()
}

#[test]
fn gathers_and_reductions_run_on_their_own_streams_and_communicators() {
    let want = reference();
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
        let (got, calls) = train(true, strategy, false);
        assert_matches(&format!("{strategy:?}"), &got, &want);
        for (rank, calls) in calls.iter().enumerate() {
            let (ag, rs) = (of(calls, "all_gather"), of(calls, "reduce_scatter"));
            // 3 units (2 blocks + root), every step: forward gathers, and reductions.
            assert!(ag.len() >= 3 * STEPS && rs.len() == 3 * STEPS, "{calls:?}");
            for c in &ag {
                assert_eq!(c.thread, format!("fsdp-unshard-rank{rank}"), "{c:?}");
                assert_eq!(c.group, 0, "gathers use the FSDP group: {c:?}");
            }
            for c in &rs {
                assert_eq!(c.thread, format!("fsdp-post-backward-rank{rank}"), "{c:?}");
                assert_ne!(c.group, 0, "reductions need their own communicator: {c:?}");
            }
            assert_eq!(
                rs[0].group,
                rs[rs.len() - 1].group,
                "one second communicator"
            );
        }
    }
}

#[test]
fn a_group_without_new_group_reduces_on_the_unshard_stream() {
    let want = reference();
    let (got, calls) = train(false, ShardingStrategy::FullShard, false);
    assert_matches("no new_group", &got, &want);
    for (rank, calls) in calls.iter().enumerate() {
        let rs = of(calls, "reduce_scatter");
        assert_eq!(rs.len(), 3 * STEPS);
        for c in rs.iter().chain(of(calls, "all_gather").iter()) {
            assert_eq!(c.thread, format!("fsdp-unshard-rank{rank}"), "{c:?}");
            assert_eq!(c.group, 0, "{c:?}");
        }
    }
}

#[test]
fn no_shard_all_reduces_on_the_post_backward_stream_without_a_second_communicator() {
    let want = reference();
    let (got, calls) = train(true, ShardingStrategy::NoShard, false);
    assert_matches("NoShard", &got, &want);
    for (rank, calls) in calls.iter().enumerate() {
        assert!(
            of(calls, "all_gather").is_empty(),
            "NoShard gathers nothing"
        );
        let ar = of(calls, "all_reduce");
        assert_eq!(ar.len(), 3 * STEPS, "{calls:?}");
        for c in ar {
            assert_eq!(c.thread, format!("fsdp-post-backward-rank{rank}"), "{c:?}");
            assert_eq!(c.group, 0, "{c:?}");
        }
    }
}

#[test]
fn offloaded_shards_are_copied_ahead_of_the_gather_with_the_same_result() {
    let want = reference();
    let (got, calls) = train(true, ShardingStrategy::FullShard, true);
    assert_matches("CpuOffload", &got, &want);
    for (rank, calls) in calls.iter().enumerate() {
        for c in of(calls, "all_gather") {
            assert_eq!(c.thread, format!("fsdp-unshard-rank{rank}"), "{c:?}");
        }
        for c in of(calls, "reduce_scatter") {
            assert_eq!(c.thread, format!("fsdp-post-backward-rank{rank}"), "{c:?}");
        }
    }
}
