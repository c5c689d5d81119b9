//! [`Device`]: where a tensor lives (`torch.device`). A leaf module: every layer names
//! devices (a tensor's storage, a backend's ops, a process group's collective device), and
//! it imports nothing, so none of them has to import the backend to say "cpu".

/// Where a tensor lives. Mirrors `torch.device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory; the reference backend.
    #[default]
    Cpu,
    /// CUDA device by ordinal. Requires the `cuda` feature and a driver.
    Cuda(usize),
    /// Shapes only, no memory (deferred initialization).
    Meta,
}

impl Device {
    /// True for `Device::Cuda(_)`.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Meta => f.write_str("meta"),
        }
    }
}
