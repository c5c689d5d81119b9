//! `--device`: where `fsdp train` computes (`torch.device` of the training script), which
//! GPU each rank uses, and the peak-FLOP/s table behind the MFU figure.

use crate::backend::Device;
use crate::error::Result;

crate::choice::choice_enum! {
    /// The device `fsdp train` runs on (`--device`), default `cpu`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
    pub enum TrainDevice: "device" {
        /// The CPU backend, the reference (`--device cpu`).
        #[default]
        Cpu = "cpu",
        /// The CUDA devices of this machine (`--device cuda`; needs the `cuda` feature, a
        /// driver and a GPU): rank `r` computes on `cuda:(r % device_count)`, so several
        /// ranks share a GPU when there are fewer GPUs than ranks.
        Cuda = "cuda",
    }
}

impl TrainDevice {
    /// Checks that the device can train: always for the CPU; for CUDA, that the build has
    /// the backend and a driver with a device is present.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda) saying what is missing (no `cuda` feature, no
    /// driver, no device), in one line.
    pub fn check(self) -> Result<()> {
        match self {
            TrainDevice::Cpu => Ok(()),
            TrainDevice::Cuda => crate::backend::cuda::detect().map(drop),
        }
    }

    /// The device rank `rank` computes on: the CPU, or `cuda:(rank % device_count)`.
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn for_rank(self, rank: usize) -> Result<Device> {
        match self {
            TrainDevice::Cpu => Ok(Device::Cpu),
            TrainDevice::Cuda => {
                let n = crate::backend::cuda::detect()?.len().max(1);
                Ok(Device::Cuda(rank % n))
            }
        }
    }

    /// Whether this is `--device cuda`.
    pub fn is_cuda(self) -> bool {
        self == TrainDevice::Cuda
    }

    /// On CUDA: why `need_bytes` (the job's estimate) does not fit the memory of the GPUs
    /// `world_size` ranks use; `None` when it fits or on the CPU (checked against host
    /// memory instead).
    pub fn memory_problem(self, need_bytes: f64, world_size: usize) -> Option<String> {
        let (gpus, name, per_gpu) = self.gpus(world_size)?;
        let have = (gpus * per_gpu) as f64;
        let gib = (1u64 << 30) as f64;
        (need_bytes > have).then(|| {
            format!(
                "this configuration needs about {:.1} GiB of device memory and {gpus} x {name} have {:.1} GiB; lower --global-batch, --seq-len, --n-embd or --n-layer",
                need_bytes / gib,
                have / gib
            )
        })
    }

    /// `(GPUs used by `world_size` ranks, name of cuda:0, total memory of cuda:0)`; `None`
    /// on the CPU or without a usable GPU.
    pub fn gpus(self, world_size: usize) -> Option<(usize, String, usize)> {
        if self != TrainDevice::Cuda {
            return None;
        }
        let devices = crate::backend::cuda::detect().ok()?;
        let first = devices.first()?;
        Some((
            world_size.min(devices.len()).max(1),
            first.name.clone(),
            first.total_memory,
        ))
    }
}

/// Dense peak FLOP/s of one GPU by marketing name and compute dtype, for MFU. Sources:
/// NVIDIA's H100 and H200 datasheets (SXM: BF16/FP16 tensor core 989 TFLOP/s dense, i.e.
/// half the "with sparsity" 1979; FP32 67 TFLOP/s; H200 has H100's compute) and the A100
/// datasheet (BF16/FP16 312 TFLOP/s dense, FP32 19.5; TF32 tensor cores are not used by
/// our f32 path). `low_precision` is bf16/f16 compute. `None` for a GPU not in the table.
pub fn peak_flops(gpu_name: &str, low_precision: bool) -> Option<f64> {
    const TABLE: &[(&str, f64, f64)] = &[
        // (name contains, bf16/f16 dense FLOP/s, f32 FLOP/s)
        ("H200", 989e12, 67e12),
        ("H100", 989e12, 67e12),
        ("A100", 312e12, 19.5e12),
    ];
    TABLE
        .iter()
        .find(|(n, _, _)| gpu_name.contains(n))
        .map(|&(_, lp, f32)| if low_precision { lp } else { f32 })
}

/// Model FLOP utilization of a run: `6 * params * tokens_per_s` (forward and backward of a
/// decoder, attention FLOPs left out, as PaLM's MFU) over the peak of `gpus` GPUs named
/// `gpu_name`; `None` when the GPU is not in [`peak_flops`]'s table.
pub fn mfu(
    num_params: usize,
    tokens_per_s: f64,
    gpu_name: &str,
    gpus: usize,
    low_precision: bool,
) -> Option<f64> {
    let peak = peak_flops(gpu_name, low_precision)? * gpus.max(1) as f64;
    Some(6.0 * num_params as f64 * tokens_per_s / peak)
}

/// The end-of-run lines of a CUDA run (empty on the CPU): tokens/s (median step, the first
/// left out as warm-up), MFU against the GPUs' peak ([`peak_flops`]; bf16/f16 dense peak
/// under mixed precision, f32 otherwise) and every rank's peak device bytes.
pub fn gpu_summary(cfg: &super::TrainConfig, report: &super::TrainReport) -> Vec<String> {
    let Some((gpus, name, _)) = cfg.device.gpus(cfg.world_size) else {
        return Vec::new();
    };
    let mut tps: Vec<f64> = report
        .records
        .iter()
        .skip(usize::from(report.records.len() > 1))
        .map(|r| r.tokens_per_s)
        .collect();
    tps.sort_by(|a, b| a.total_cmp(b));
    let tps = tps.get(tps.len() / 2).copied().unwrap_or(f64::NAN);
    let lp = matches!(
        cfg.mixed_precision,
        super::Precision::Bf16 | super::Precision::F16
    );
    let mfu = mfu(report.num_params, tps, &name, gpus, lp).map_or_else(
        || "- (GPU not in the peak table)".to_string(),
        |m| format!("{:.1}%", m * 100.0),
    );
    let mut out = vec![format!(
        "gpu: {gpus} x {name}, world size {}: {tps:.0} tokens/s (median step), MFU {mfu} (6 x {} params x tokens/s over the {} peak)",
        cfg.world_size,
        report.num_params,
        if lp { "bf16/f16 dense" } else { "f32" }
    )];
    if let Some(r) = report.records.last() {
        let peaks: Vec<String> = r
            .ranks
            .iter()
            .map(|m| {
                format!(
                    "rank {}: {:.1} MiB",
                    m.rank,
                    m.device_peak_bytes as f64 / (1u64 << 20) as f64
                )
            })
            .collect();
        out.push(format!("peak device memory per rank: {}", peaks.join(", ")));
    }
    out.extend(exposed_comm_summary(report));
    out.extend(counters_summary(report));
    out
}

/// The exposed communication of the steps after the first: every rank's `comm_wait_us`
/// (on CUDA the time its compute stream stood still waiting for a collective) over the
/// step time, summed over those steps; the ranks' range when there are several.
pub fn exposed_comm_summary(report: &super::TrainReport) -> Option<String> {
    let steady = report.records.get(1..).filter(|r| !r.is_empty())?;
    let step_s: f64 = steady.iter().map(|r| r.step_time_s).sum();
    if step_s <= 0.0 {
        return None;
    }
    let ranks = steady.iter().map(|r| r.ranks.len()).min().unwrap_or(0);
    let fractions: Vec<f64> = (0..ranks)
        .map(|i| {
            let us: usize = steady.iter().map(|r| r.ranks[i].comm_wait_us).sum();
            us as f64 / 1e6 / step_s
        })
        .collect();
    let lo = fractions.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = fractions.iter().copied().fold(0.0, f64::max);
    if fractions.is_empty() {
        return None;
    }
    let range = if fractions.len() == 1 || (hi - lo) < 5e-4 {
        format!("{:.1}%", hi * 100.0)
    } else {
        format!("{:.1}%-{:.1}% over the ranks", lo * 100.0, hi * 100.0)
    };
    Some(format!(
        "exposed communication from step 2: {range} of step time (compute stalled on collectives)"
    ))
}

/// The per-step counters (`backend::counters`) of the steps after the first, as medians:
/// what a GPU step asks of the host.
pub fn counters_summary(report: &super::TrainReport) -> Option<String> {
    let steady: Vec<_> = report.records.iter().skip(1).map(|r| r.counters).collect();
    if steady.is_empty() {
        return None;
    }
    let median = |f: fn(&crate::backend::counters::Counters) -> u64| {
        let mut v: Vec<u64> = steady.iter().map(f).collect();
        v.sort_unstable();
        v[v.len() / 2]
    };
    Some(format!(
        "per step from step 2 (median, rank 0's process): {} host syncs, {} device allocs, {} allocator requests ({} for FSDP buffers), {} kernel launches, {} store ops, {} event queries",
        median(|c| c.host_syncs),
        median(|c| c.device_allocs),
        median(|c| c.allocator_requests),
        median(|c| c.fsdp_buffer_allocs),
        median(|c| c.kernel_launches),
        median(|c| c.store_ops),
        median(|c| c.event_queries),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_table_and_mfu() {
        assert_eq!(peak_flops("NVIDIA H200", true), Some(989e12));
        assert_eq!(peak_flops("NVIDIA H200", false), Some(67e12));
        assert_eq!(peak_flops("NVIDIA GeForce RTX 4090", true), None);
        // 100M parameters at 100k tokens/s on one H200 in bf16: 6e13 / 9.89e14.
        let m = mfu(100_000_000, 100_000.0, "NVIDIA H200", 1, true).unwrap();
        assert!((m - 6e13 / 989e12).abs() < 1e-12);
    }

    fn record(step_time_s: f64, waits_us: &[usize]) -> crate::train::StepRecord {
        crate::train::StepRecord {
            step: 1,
            loss: 0.0,
            tokens_per_s: 0.0,
            step_time_s,
            grad_norm: None,
            loss_scale: None,
            skipped: false,
            eval_loss: None,
            ranks: waits_us
                .iter()
                .map(|&comm_wait_us| crate::train::engine::RankMemory {
                    comm_wait_us,
                    ..Default::default()
                })
                .collect(),
            counters: Default::default(),
        }
    }

    #[test]
    fn exposed_communication_is_stall_over_step_time_after_the_first_step() {
        let report = |records| crate::train::TrainReport {
            num_params: 0,
            records,
            sample: String::new(),
            elapsed_s: 0.0,
            init_peak_bytes: Vec::new(),
        };
        // The first step (warm-up, 10 s of waits) is left out: 0.3 s of 2 s, and 0.1 s.
        let r = report(vec![
            record(10.0, &[10_000_000, 0]),
            record(1.0, &[200_000, 100_000]),
            record(1.0, &[100_000, 0]),
        ]);
        assert_eq!(
            exposed_comm_summary(&r).unwrap(),
            "exposed communication from step 2: 5.0%-15.0% over the ranks of step time (compute stalled on collectives)"
        );
        let one = report(vec![record(1.0, &[0]), record(0.5, &[50_000])]);
        assert!(exposed_comm_summary(&one)
            .unwrap()
            .contains(": 10.0% of step time"));
        assert!(exposed_comm_summary(&report(vec![record(1.0, &[0])])).is_none());
    }

    #[test]
    fn cpu_ranks_stay_on_the_cpu() {
        assert_eq!(TrainDevice::Cpu.for_rank(3).unwrap(), Device::Cpu);
        assert!(TrainDevice::Cpu.gpus(4).is_none());
    }
}
