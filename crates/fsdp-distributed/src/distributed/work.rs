//! Asynchronous collectives: a [`CommStream`] runs collectives on its own thread, in the
//! order they were issued, and each issue returns a [`Work`] handle to wait on
//! (`torch.distributed`'s `async_op=True` and `Work.wait()` / `Work.is_completed()`).
//!
//! A stream plays the part of a CUDA communication stream: the rank's thread goes on
//! computing while the collective runs. Every rank must issue the same collectives on its
//! streams in the same order (as with NCCL). A stream's collectives are ordered among
//! themselves only, so a rank must [`synchronize`](CommStream::synchronize) its stream
//! before it calls a blocking collective on a group the stream also uses (FSDP does this at
//! the end of every forward and backward).
//!
//! # On a CUDA device
//!
//! [`CommStream::on_device`] with `Device::Cuda(i)` gives the thread its own CUDA stream
//! (FSDP's unshard / post-backward stream: its copies and reductions overlap the rank's
//! compute stream), made its current stream for the thread's life and charged to the
//! memory account of the rank that created it. Ordering between the two streams:
//! - at submit, an event is recorded on the submitting thread's current stream and the
//!   job's stream waits on it before the job runs, so the job sees everything the rank
//!   queued before submitting (the buffer it fills was zeroed, the gradient computed);
//! - after the job, the thread records a second event on its stream and completes the
//!   [`Work`] with it: the host never waits for the device here. [`Work::wait`] makes the
//!   waiting thread's current stream wait for that event (`cuStreamWaitEvent`), so what
//!   the waiter queues next on the device sees the job's results; the host sees them once
//!   it reads them (every copy to the host synchronizes). This is PyTorch's
//!   `Work.wait()` on a NCCL work: a device-side wait, no host block;
//! - the tensors given to [`submit_keeping`](CommStream::submit_keeping) (and those of the
//!   typed collectives) are marked as used by the job's stream before the job drops them
//!   (`Tensor.record_stream`): when the rank frees one, its block goes back to the
//!   allocator only behind an event of the job's stream, so no later allocation reuses
//!   memory the stream still reads or writes.
//!
//! On the host the same code runs without the events: a job's results are complete when
//! its `Work` completes.
//!
//! A job runs under the [`fingerprint`](super::fingerprint) its submitter had at submit
//! time, so the collectives it calls say what the rank was doing when it issued them.
//!
//! As an NCCL communicator aborts on error, a stream whose job fails runs no further jobs:
//! they all fail with a copy of that first error, so every wait reports the root cause
//! (say, the collective mismatch) rather than a later echo of it.

use super::{CollectivesExt, Group, ReduceOp};
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use parking_lot::{Condvar, Mutex};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

struct WorkState {
    done: Mutex<Option<Done>>,
    cv: Condvar,
}

/// How a job ended: its result and, on a CUDA stream, the event after its device work.
struct Done {
    result: Result<()>,
    after: After,
}

/// On a CUDA stream: the device and an event recorded after the job's work on it, which a
/// waiter's stream waits for.
type After = Option<(usize, crate::backend::cuda::Event)>;

/// Handle to one asynchronous collective (`torch.distributed.Work`). Dropping it does not
/// cancel the collective; [`CommStream::synchronize`] still waits for it.
#[must_use = "a Work must be waited on before its tensors are used"]
pub struct Work {
    state: Arc<WorkState>,
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl Work {
    fn pending() -> (Work, Arc<WorkState>) {
        let state = Arc::new(WorkState {
            done: Mutex::new(None),
            cv: Condvar::new(),
        });
        (
            Work {
                state: state.clone(),
            },
            state,
        )
    }

    /// A handle that is already complete with `result` (what a blocking call returns when
    /// asked for a `Work`).
    pub fn completed(result: Result<()>) -> Work {
        let (w, s) = Work::pending();
        *s.done.lock() = Some(Done {
            result,
            after: None,
        });
        w
    }

    /// Whether the collective has finished (successfully or not); on a CUDA stream, whether
    /// its device work has been queued (see the module docs). Never blocks.
    pub fn is_completed(&self) -> bool {
        self.state.done.lock().is_some()
    }

    /// Blocks until the collective finishes and returns its result; its output tensors are
    /// then complete and its inputs free to reuse. On a CUDA stream it blocks only until
    /// the job's device work is queued, and makes the calling thread's current stream wait
    /// for it: work the caller queues afterwards, and any copy to the host, sees the
    /// results (`torch.distributed.Work.wait` on NCCL). Returns how long it blocked with
    /// [`wait_timed`](Self::wait_timed).
    ///
    /// # Errors
    /// The collective's error (mismatch, timeout naming the missing ranks, a failed peer);
    /// [`Error::Cuda`] when the stream wait cannot be queued.
    pub fn wait(self) -> Result<()> {
        self.wait_timed().0
    }

    /// [`wait`](Self::wait), also returning the time spent blocked.
    pub fn wait_timed(self) -> (Result<()>, Duration) {
        let t0 = Instant::now();
        let mut done = self.state.done.lock();
        while done.is_none() {
            self.state.cv.wait(&mut done);
        }
        let r = match done.take() {
            Some(d) => d.result.and_then(|()| wait_on_device(d.after)),
            None => Ok(()),
        };
        (r, t0.elapsed())
    }
}

/// Makes the calling thread's current stream on the job's device wait for the job.
fn wait_on_device(after: After) -> Result<()> {
    match after {
        // Timed: how long the consumer stream stands still here is the exposed part of
        // the job (backend::cuda::take_stream_stall_s).
        Some((ordinal, ev)) => crate::backend::cuda::current_stream(ordinal)?.wait_timed(&ev),
        None => Ok(()),
    }
}

fn finish(state: &WorkState, result: Result<()>, after: After) {
    *state.done.lock() = Some(Done { result, after });
    state.cv.notify_all();
}

type Job = Box<dyn FnOnce() -> Result<()> + Send>;

/// What a job waits for before it runs: on a CUDA stream, an event recorded on the
/// submitting thread's current stream at submit time.
type Ready = Option<crate::backend::cuda::Event>;

/// One submitted job, with the tensors kept alive until its stream work is done.
struct Queued {
    job: Job,
    state: Arc<WorkState>,
    ready: Ready,
    keep: Vec<Tensor>,
}

/// The device side of a stream thread: its CUDA stream, or nothing on the host.
struct DeviceSide {
    stream: Option<(
        Arc<crate::backend::cuda::Stream>,
        crate::backend::cuda::StreamGuard,
    )>,
}

impl DeviceSide {
    /// Called on the stream thread: makes the stream (created by [`CommStream::on_device`]
    /// on the rank's thread) current and charges the thread's allocations to `account`.
    fn enter(
        stream: Option<(
            Arc<crate::backend::cuda::Stream>,
            Arc<crate::backend::cuda::MemAccount>,
        )>,
    ) -> DeviceSide {
        use crate::backend::cuda;
        DeviceSide {
            stream: stream.map(|(s, account)| {
                cuda::set_rank_account(account);
                let guard = cuda::use_stream(s.clone());
                (s, guard)
            }),
        }
    }

    /// Runs one job: make the stream wait for the submitter's work, run the job, mark the
    /// kept tensors as used by the stream, release them, and return the job's result with
    /// an event after its device work (no host wait).
    fn run(&self, q: Queued) -> (Result<()>, After) {
        let Queued {
            job, ready, keep, ..
        } = q;
        if let (Some((s, _)), Some(ev)) = (&self.stream, &ready) {
            if let Err(e) = s.wait(ev) {
                return (Err(e), None);
            }
        }
        let r = job();
        if let Some((s, _)) = &self.stream {
            // Also after an error: the buffers of whatever the job queued go back to the
            // allocator only behind this stream's work.
            for t in &keep {
                if let Ok(d) = t.as_device_tensor() {
                    s.record_use(d.buffer());
                }
            }
            drop(keep);
            return match r.and_then(|()| s.record()) {
                Ok(ev) => (Ok(()), Some((s.device().ordinal(), ev))),
                Err(e) => (Err(e), None),
            };
        }
        drop(keep);
        (r, None)
    }
}

/// One rank's communication stream: a thread that runs the submitted jobs (collectives and
/// the copies and casts around them) one at a time in submission order.
pub struct CommStream {
    tx: Option<mpsc::Sender<Queued>>,
    thread: Option<JoinHandle<()>>,
    pending: Arc<(Mutex<usize>, Condvar)>,
    device: Device,
}

impl std::fmt::Debug for CommStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommStream")
            .field("device", &self.device)
            .field("pending", &*self.pending.0.lock())
            .finish()
    }
}

impl CommStream {
    /// Starts a host stream thread named `name` (shown in debuggers and panics).
    ///
    /// # Errors
    /// `Io` when the thread cannot be spawned.
    pub fn new(name: &str) -> Result<CommStream> {
        Self::on_device(name, Device::Cpu)
    }

    /// Starts a stream thread named `name` for collectives on `device`: on `Device::Cuda(i)`
    /// the thread gets its own CUDA stream on that device, charged to the calling thread's
    /// memory account (call it on the rank's thread; see the module docs for the ordering);
    /// on the host (or meta) it is [`CommStream::new`].
    ///
    /// # Errors
    /// `Io` when the thread cannot be spawned; [`Error::Cuda`] when the device or its
    /// stream cannot be had (and without the `cuda` feature for a CUDA device).
    pub fn on_device(name: &str, device: Device) -> Result<CommStream> {
        let stream = match device {
            Device::Cuda(i) => {
                use crate::backend::cuda;
                let account = cuda::rank_account();
                let dev = cuda::CudaDevice::get(i)?;
                Some((Arc::new(cuda::Stream::new(&dev, account.clone())?), account))
            }
            _ => None,
        };
        let (tx, rx) = mpsc::channel::<Queued>();
        let pending = Arc::new((Mutex::new(0usize), Condvar::new()));
        let p = pending.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let side = DeviceSide::enter(stream);
                let mut failed: Option<Error> = None;
                while let Ok(q) = rx.recv() {
                    let state = q.state.clone();
                    if let Some(e) = &failed {
                        drop(q);
                        finish(&state, Err(e.duplicate()), None);
                        let mut n = p.0.lock();
                        *n -= 1;
                        p.1.notify_all();
                        continue;
                    }
                    let (r, after) =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| side.run(q)))
                            .unwrap_or_else(|p| {
                                let msg = p
                                    .downcast_ref::<&str>()
                                    .map(|s| s.to_string())
                                    .or_else(|| p.downcast_ref::<String>().cloned())
                                    .unwrap_or_else(|| "unknown panic".into());
                                let e = Error::Fsdp(format!("communication job panicked: {msg}"));
                                (Err(e), None)
                            });
                    if let Err(e) = &r {
                        failed = Some(e.duplicate());
                    }
                    finish(&state, r, after);
                    let mut n = p.0.lock();
                    *n -= 1;
                    p.1.notify_all();
                }
            })
            .map_err(|e| Error::io(format!("starting communication thread '{name}'"), e))?;
        Ok(CommStream {
            tx: Some(tx),
            thread: Some(thread),
            pending,
            device,
        })
    }

    /// The device whose collectives this stream runs.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Queues `job` behind every job submitted before it and returns its handle. On a CUDA
    /// stream, tensors the job captures are dropped when it returns, possibly before its
    /// queued device work ran: pass them to [`submit_keeping`](Self::submit_keeping).
    pub fn submit(&self, job: impl FnOnce() -> Result<()> + Send + 'static) -> Work {
        self.submit_keeping(Vec::new(), job)
    }

    /// [`submit`](Self::submit), keeping clones of `keep` alive until the job and its work
    /// on the stream are done (the buffers it reads or fills that the rank allocated).
    pub fn submit_keeping(
        &self,
        keep: Vec<Tensor>,
        job: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Work {
        let ready = match self.record_ready() {
            Ok(r) => r,
            Err(e) => return Work::completed(Err(e)),
        };
        let (work, state) = Work::pending();
        *self.pending.0.lock() += 1;
        // The job's collectives say what the submitter was doing (see `fingerprint`).
        let tag = super::fingerprint::current();
        let q = Queued {
            job: Box::new(move || {
                let _tag = super::fingerprint::enter(tag);
                job()
            }),
            state: state.clone(),
            ready,
            keep,
        };
        let sent = match &self.tx {
            Some(tx) => tx.send(q).is_ok(),
            None => false,
        };
        if !sent {
            self.done_one();
            finish(
                &state,
                Err(Error::Fsdp("communication stream has stopped".into())),
                None,
            );
        }
        work
    }

    /// On a CUDA stream: an event after the work queued so far on the calling thread's
    /// current stream of the device.
    fn record_ready(&self) -> Result<Ready> {
        if let Device::Cuda(i) = self.device {
            return Ok(Some(crate::backend::cuda::current_stream(i)?.record()?));
        }
        Ok(None)
    }

    fn done_one(&self) {
        let mut n = self.pending.0.lock();
        *n = n.saturating_sub(1);
        self.pending.1.notify_all();
    }

    /// Blocks until every job submitted so far has finished; returns the time spent blocked.
    /// Errors stay with each job's [`Work`].
    pub fn synchronize(&self) -> Duration {
        let t0 = Instant::now();
        let mut n = self.pending.0.lock();
        while *n > 0 {
            self.pending.1.wait(&mut n);
        }
        t0.elapsed()
    }

    /// Number of jobs submitted and not yet finished.
    pub fn pending(&self) -> usize {
        *self.pending.0.lock()
    }

    /// Asynchronous [`ProcessGroup::all_gather_into_tensor`](super::ProcessGroup::all_gather_into_tensor).
    /// `output` must not be read, nor `input` written, before the `Work` completes.
    pub fn all_gather_into_tensor(&self, pg: &Group, output: &Tensor, input: &Tensor) -> Work {
        let (pg, out, inp) = (pg.clone(), output.clone(), input.clone());
        let keep = vec![output.clone(), input.clone()];
        self.submit_keeping(keep, move || pg.all_gather_into_tensor(&out, &inp))
    }

    /// Asynchronous [`ProcessGroup::reduce_scatter_tensor`](super::ProcessGroup::reduce_scatter_tensor).
    pub fn reduce_scatter_tensor(
        &self,
        pg: &Group,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Work {
        let (pg, out, inp) = (pg.clone(), output.clone(), input.clone());
        let keep = vec![output.clone(), input.clone()];
        self.submit_keeping(keep, move || pg.reduce_scatter_tensor(&out, &inp, op))
    }

    /// Asynchronous [`ProcessGroup::all_reduce`](super::ProcessGroup::all_reduce).
    pub fn all_reduce(&self, pg: &Group, tensor: &Tensor, op: ReduceOp) -> Work {
        let (pg, t) = (pg.clone(), tensor.clone());
        self.submit_keeping(vec![tensor.clone()], move || pg.all_reduce(&t, op))
    }

    /// Asynchronous [`ProcessGroup::broadcast`](super::ProcessGroup::broadcast).
    pub fn broadcast(&self, pg: &Group, tensor: &Tensor, src: usize) -> Work {
        let (pg, t) = (pg.clone(), tensor.clone());
        self.submit_keeping(vec![tensor.clone()], move || pg.broadcast(&t, src))
    }

    /// Asynchronous [`ProcessGroup::barrier`](super::ProcessGroup::barrier).
    pub fn barrier(&self, pg: &Group) -> Work {
        let pg = pg.clone();
        self.submit(move || pg.barrier())
    }

    /// Asynchronous [`CollectivesExt::reduce`].
    pub fn reduce(&self, pg: &Group, tensor: &Tensor, dst: usize, op: ReduceOp) -> Work {
        let (pg, t) = (pg.clone(), tensor.clone());
        self.submit_keeping(vec![tensor.clone()], move || pg.reduce(&t, dst, op))
    }

    /// Asynchronous [`CollectivesExt::all_gather`] (list form).
    pub fn all_gather(&self, pg: &Group, outputs: &[Tensor], input: &Tensor) -> Work {
        let (pg, outs, inp) = (pg.clone(), outputs.to_vec(), input.clone());
        let keep = outputs.iter().chain([input]).cloned().collect();
        self.submit_keeping(keep, move || pg.all_gather(&outs, &inp))
    }

    /// Asynchronous [`CollectivesExt::gather`].
    pub fn gather(
        &self,
        pg: &Group,
        input: &Tensor,
        outputs: Option<&[Tensor]>,
        dst: usize,
    ) -> Work {
        let (pg, inp, outs) = (pg.clone(), input.clone(), outputs.map(<[Tensor]>::to_vec));
        let keep = outputs
            .unwrap_or(&[])
            .iter()
            .chain([input])
            .cloned()
            .collect();
        self.submit_keeping(keep, move || pg.gather(&inp, outs.as_deref(), dst))
    }

    /// Asynchronous [`CollectivesExt::scatter`].
    pub fn scatter(
        &self,
        pg: &Group,
        output: &Tensor,
        inputs: Option<&[Tensor]>,
        src: usize,
    ) -> Work {
        let (pg, out, ins) = (pg.clone(), output.clone(), inputs.map(<[Tensor]>::to_vec));
        let keep = inputs
            .unwrap_or(&[])
            .iter()
            .chain([output])
            .cloned()
            .collect();
        self.submit_keeping(keep, move || pg.scatter(&out, ins.as_deref(), src))
    }

    /// Asynchronous [`CollectivesExt::all_to_all_single`].
    pub fn all_to_all_single(&self, pg: &Group, output: &Tensor, input: &Tensor) -> Work {
        let (pg, out, inp) = (pg.clone(), output.clone(), input.clone());
        let keep = vec![output.clone(), input.clone()];
        self.submit_keeping(keep, move || pg.all_to_all_single(&out, &inp))
    }
}

impl Drop for CommStream {
    /// Finishes the queued jobs, then stops the thread.
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
