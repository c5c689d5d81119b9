//! `fsdp train --device cuda --cuda-graphs`: the training step as one CUDA graph.
//!
//! The first step runs eagerly (kernel modules, cuBLAS handles, FSDP's buffers and the
//! optimizer's state are made then). The second runs eagerly too, with its buffers from the
//! graph's private pool (the warm-up, `backend::cuda::GraphRecorder::warm_up`). The third
//! is captured (`cuStreamBeginCapture` ... `cuStreamEndCapture`) and launched, and every
//! later step is one `cuGraphLaunch`: no kernel is launched from the host.
//!
//! What changes from step to step lives in device memory the graph reads or writes, never
//! in the graph as a constant: the batch is copied into static device buffers before each
//! launch, the loss (and grad norm) are written to static scalars by the graph and copied
//! into `pending`'s slots after it (device-to-device copies, no kernel), and Adam's step
//! count is kept and advanced on the device (`kernels/graph.cu`), and so is the learning
//! rate: the schedule's rate of every step from the warm-up on is computed once on the
//! host by the run's scheduler and uploaded as a table of the graph's, indexed on the
//! device by the step count (`backend::cuda::GraphRecorder::set_lr_table`). What would
//! need the host inside the step is refused up front ([`check`]): a schedule with SGD
//! (its kernel takes the rate as an argument), the grad scaler (it skips steps on the
//! host), CPU offload, saving checkpoints (the host's optimizer state does not follow the
//! replays), and thread ranks ([`check_thread_ranks`]). Memory figures of replayed steps
//! are the warm-up step's.
//!
//! At world size above 1 each rank is a process (`fsdp launch`, backend `nccl`) and
//! captures its own step with its NCCL collectives: FSDP's communication streams join the
//! capture through the events they wait on and are joined back by the compute stream's
//! waits, and each launch runs the step's collectives in their captured order on every
//! rank.

use super::config::TrainConfig;
use super::data::Split;
use super::data::TextDataset;
use super::engine::{Engine, RankMemory};
use super::pending::Pending;
use crate::backend::counters::Counters;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::nn::{loss, Context};
use crate::optim::Optimizer;
use crate::tensor::{DType, Tensor};

/// Refuses `--cuda-graphs` with what a captured step cannot hold, naming the option.
///
/// # Errors
/// `InvalidArgument` naming the conflicting option.
pub(super) fn check(cfg: &TrainConfig) -> Result<()> {
    if !cfg.cuda_graphs {
        return Ok(());
    }
    let bad = |m: &str| Err(Error::InvalidArgument(format!("--cuda-graphs: {m}")));
    if !matches!(cfg.device, super::TrainDevice::Cuda) {
        return bad("needs --device cuda");
    }
    let scheduled = cfg.effective_warmup() > 0 || cfg.lr_schedule != super::LrSchedule::Constant;
    if scheduled && cfg.optimizer == crate::optim::OptimizerKind::Sgd {
        return bad(
            "--optimizer sgd takes a constant learning rate only (pass --warmup-steps 0 and --lr-schedule constant): its captured kernel keeps the captured step's rate; adam and adamw read each step's rate on the device",
        );
    }
    if cfg.uses_grad_scaler() {
        return bad("the grad scaler decides on the host whether to step (pass --no-grad-scaler)");
    }
    if cfg.cpu_offload {
        return bad("--cpu-offload steps the optimizer on the host");
    }
    if cfg.save_dir.is_some() {
        return bad("--save-dir: the host's optimizer state does not follow replayed steps");
    }
    if cfg.no_fsdp && cfg.clip_grad_norm.is_some() {
        return bad(
            "--no-fsdp with --clip-grad-norm reads the norm on the host (pass --clip-grad-norm 0)",
        );
    }
    Ok(())
}

/// Refuses `--cuda-graphs` for ranks that are threads of one process (`fsdp train
/// --world-size N`, N > 1): each rank would capture its own step, and the `threads`
/// backend's collectives make a rank's stream wait on its peers' events, recorded in their
/// captures or outside any, which a capture refuses (`CUDA_ERROR_STREAM_CAPTURE_MERGE`,
/// `_ISOLATION`; docs/cuda.md). Ranks that are processes (`fsdp launch`, backend `nccl`)
/// each capture their step with its NCCL collectives.
///
/// # Errors
/// `InvalidArgument` naming the way to run it.
pub(super) fn check_thread_ranks(cfg: &TrainConfig) -> Result<()> {
    if cfg.cuda_graphs && cfg.world_size > 1 {
        return Err(Error::InvalidArgument(format!(
            "--cuda-graphs at --world-size {n} captures one rank per process: run `fsdp launch --nproc-per-node {n} -- fsdp train --world-size {n} ...` (backend nccl: each process captures its step with its collectives); thread ranks cannot be captured (the threads backend makes each rank's stream wait on its peers' events, which are outside its capture)",
            n = cfg.world_size
        )));
    }
    Ok(())
}

/// The static buffers and the graph of a `--cuda-graphs` run on one rank (without the
/// `cuda` feature only made to be refused at the first step).
pub(super) struct GraphSteps {
    first: usize,
    /// The learning rate of every step from the warm-up (`first + 1`) on, for the graph.
    lrs: Vec<f32>,
    device: Device,
    /// Per micro-batch: input and target ids `(rows, t)` i32.
    x: Vec<Tensor>,
    y: Vec<Tensor>,
    /// `[1]` f32: the step's loss and grad norm, written by the graph.
    loss: Tensor,
    norm: Tensor,
    recorder: Option<crate::backend::cuda::GraphRecorder>,
    graph: Option<crate::backend::cuda::StepGraph>,
    mem: RankMemory,
}

impl GraphSteps {
    /// The buffers of a `--cuda-graphs` run whose first step is `first` (eager), or None
    /// without the flag. `lr_of(step)` is the learning rate of 1-based step `step` (the
    /// run's scheduler: the rate the eager step would set).
    ///
    /// # Errors
    /// The device's allocation errors.
    pub fn new(
        cfg: &TrainConfig,
        device: Device,
        first: usize,
        lr_of: impl Fn(usize) -> f32,
    ) -> Result<Option<GraphSteps>> {
        if !cfg.cuda_graphs {
            return Ok(None);
        }
        let rows = cfg.global_batch / cfg.grad_accum / cfg.world_size;
        let ids = || Tensor::zeros_on(&[rows, cfg.seq_len], DType::I32, device);
        crate::backend::cuda::time_stream_waits(false); // its event queries are not capturable
        Ok(Some(GraphSteps {
            first,
            lrs: (first + 1..=cfg.steps).map(lr_of).collect(),
            device,
            x: (0..cfg.grad_accum).map(|_| ids()).collect::<Result<_>>()?,
            y: (0..cfg.grad_accum).map(|_| ids()).collect::<Result<_>>()?,
            loss: Tensor::zeros_on(&[1], DType::F32, device)?,
            norm: Tensor::zeros_on(&[1], DType::F32, device)?,
            recorder: None,
            graph: None,
            mem: RankMemory::default(),
        }))
    }

    /// Whether step `step` runs through the graph (every step after the first).
    pub fn takes(&self, step: usize) -> bool {
        step > self.first
    }

    /// Runs step `step`: warm-up, capture and launch, or replay. Returns the step's counter
    /// reading at its start and its memory figures.
    ///
    /// # Errors
    /// A refused capture (named), the device's and the model's errors.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        step: usize,
        cfg: &TrainConfig,
        data: &TextDataset,
        rank: usize,
        engine: &mut Engine,
        opt: &mut dyn Optimizer,
        pending: &mut Pending,
    ) -> Result<(Counters, RankMemory)> {
        let (c0, loss_slot, norm_slot) = pending.begin_graph()?;
        let t = cfg.seq_len;
        let micro = cfg.global_batch / cfg.grad_accum;
        let micro_rows = micro / cfg.world_size;
        let Device::Cuda(ordinal) = self.device else {
            return Err(Error::InvalidArgument(
                "--cuda-graphs needs --device cuda".into(),
            ));
        };
        let s = crate::backend::cuda::current_stream(ordinal)?;
        for k in 0..cfg.grad_accum {
            let lo = k * micro + rank * micro_rows;
            let (x, y) = data.batch(Split::Train, cfg.seed, step as u64, lo..lo + micro_rows, t);
            self.x[k].as_device_tensor()?.copy_from_slice(&s, &x)?;
            self.y[k].as_device_tensor()?.copy_from_slice(&s, &y)?;
        }
        if let Some(g) = &self.graph {
            g.launch()?;
        } else if let Some(rec) = self.recorder.take() {
            let (g, ()) = rec.capture(|| self.body(cfg, rank, engine, opt, false))?;
            g.launch()?;
            self.graph = Some(g);
        } else {
            let mut rec = crate::backend::cuda::GraphRecorder::new(&s)?;
            if self.lrs.len() >= 2 {
                // A run that reaches the capture (the warm-up's rate first).
                rec.set_lr_table(std::mem::take(&mut self.lrs))?;
            }
            rec.warm_up(|| self.body(cfg, rank, engine, opt, true))?;
            self.recorder = Some(rec);
        }
        copy_scalar(&s, &loss_slot, &self.loss)?;
        if cfg.clip_grad_norm.is_some() {
            copy_scalar(&s, &norm_slot, &self.norm)?;
        }
        Ok((c0, self.mem))
    }

    /// The step's device work, captured or not: forward and backward of every micro-batch
    /// from the static ids, the loss into `self.loss`, clipping (the norm into
    /// `self.norm`), the optimizer step, `zero_grad`. With `measure`, the memory figures.
    fn body(
        &mut self,
        cfg: &TrainConfig,
        rank: usize,
        engine: &mut Engine,
        opt: &mut dyn Optimizer,
        measure: bool,
    ) -> Result<()> {
        let k_total = cfg.grad_accum;
        crate::ops::fill_(&self.loss, 0.0)?;
        for k in 0..k_total {
            let logits = engine.module().forward(&self.x[k], &Context::train())?;
            let (lk, dlogits) = loss::cross_entropy_tensor_scaled(&logits, &self.y[k], 1.0)?;
            drop(logits);
            crate::ops::add_div_(&self.loss, &lk, k_total as f32)?;
            if k_total > 1 {
                crate::ops::scale_(&dlogits, 1.0 / k_total as f32)?;
            }
            engine.backward(&dlogits, cfg.no_sync && k + 1 < k_total)?;
        }
        let params = engine.optimizer_params();
        if let Some(c) = cfg.clip_grad_norm {
            let n = engine.clip_grad_norm_tensor(c)?;
            crate::ops::fill_(&self.norm, 0.0)?;
            crate::ops::add_(&self.norm, &n)?;
        }
        opt.step(&params)?;
        drop(params);
        if measure {
            self.mem = engine.memory(rank, opt);
        }
        engine.zero_grad();
        Ok(())
    }
}

/// `dst = src` for one-element f32 device tensors, as a device-to-device copy (no kernel),
/// ordered on `s` after the graph that writes `src` and before the flush that reads `dst`.
fn copy_scalar(s: &crate::backend::cuda::Stream, dst: &Tensor, src: &Tensor) -> Result<()> {
    dst.as_device_tensor()?
        .copy_from_device(s, &src.as_device_tensor()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Thread ranks are refused naming `fsdp launch`; one rank, or ranks that are processes
    /// (what `check` sees under `fsdp launch`), pass.
    #[test]
    fn graphs_at_world_size_2_need_one_process_per_rank() {
        let cfg = |world_size| TrainConfig {
            world_size,
            cuda_graphs: true,
            device: super::super::TrainDevice::Cuda,
            ..TrainConfig::default()
        };
        let e = check_thread_ranks(&cfg(2)).unwrap_err().to_string();
        assert!(
            e.contains("--cuda-graphs at --world-size 2")
                && e.contains("fsdp launch --nproc-per-node 2"),
            "{e}"
        );
        check_thread_ranks(&cfg(1)).unwrap();
        check(&cfg(2)).unwrap();
        let off = TrainConfig {
            cuda_graphs: false,
            ..cfg(2)
        };
        check_thread_ranks(&off).unwrap();
    }
}
