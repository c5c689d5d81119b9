//! `--device`: where `fsdp train` computes (`torch.device` of the training script).

use crate::error::{Error, Result};

/// The device `fsdp train` runs on (`--device`), default `cpu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
pub enum TrainDevice {
    /// The CPU backend, the reference (`--device cpu`).
    #[default]
    Cpu,
    /// CUDA device 0 (`--device cuda`; needs the `cuda` feature, a driver and a GPU).
    Cuda,
}

impl std::fmt::Display for TrainDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TrainDevice::Cpu => "cpu",
            TrainDevice::Cuda => "cuda",
        })
    }
}

impl TrainDevice {
    /// Checks that the device can train: always for the CPU; for CUDA, that the build has
    /// the backend and a driver with a device is present.
    ///
    /// # Errors
    /// [`Error::Cuda`] saying what is missing (no `cuda` feature, no driver, no device), in
    /// one line; `Unsupported` on a machine with a GPU, since the FSDP runtime on device
    /// tensors is not built yet (the kernels, allocator, streams and cuBLAS are: see
    /// `backend::cuda` and `scripts/gpu-check.sh`).
    pub fn check(self) -> Result<()> {
        match self {
            TrainDevice::Cpu => Ok(()),
            TrainDevice::Cuda => {
                let devices = crate::backend::cuda::detect()?;
                let names: Vec<String> = devices
                    .iter()
                    .map(|d| format!("cuda:{} {}", d.ordinal, d.name))
                    .collect();
                Err(Error::Unsupported(format!(
                    "--device cuda: found {}, but training on CUDA tensors (the FSDP runtime on device buffers, NCCL) is not built yet; the CUDA kernels, allocator, streams and cuBLAS are (scripts/gpu-check.sh tests them)",
                    names.join(", ")
                )))
            }
        }
    }
}
