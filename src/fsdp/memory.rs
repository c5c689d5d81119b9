//! Per-rank memory accounting of FSDP buffers (bytes), for metrics and benches.

/// Bytes held by one rank's FSDP state. Shard figures are sums over the rank's units;
/// the unsharded figures follow every unshard/reshard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryStats {
    /// f32 parameter shards (padding included).
    pub param_shard_bytes: usize,
    /// f32 gradient shards currently held.
    pub grad_shard_bytes: usize,
    /// Unsharded (gathered) parameter buffers alive now.
    pub unsharded_param_bytes: usize,
    /// Most unsharded parameter bytes alive at once since the last reset.
    pub peak_unsharded_param_bytes: usize,
    /// Units unsharded now, and the most at once since the last reset.
    pub unsharded_units: usize,
    /// Most units unsharded at once since the last [`reset_peak`](Self::reset_peak).
    pub peak_unsharded_units: usize,
    /// With [`CpuOffload`](super::CpuOffload): the parameter and gradient shards above are
    /// in host memory, not on the compute device.
    pub cpu_offload: bool,
    /// Most bytes of parameters this rank held at once while FSDP was being built:
    /// materialized original parameters plus the shards made so far. A model built on the
    /// meta device with initializers holds only its shards.
    pub init_peak_bytes: usize,
    /// Bytes of the activations saved for backward in the root's last training step: at
    /// the end of its forward ([`crate::nn::saved_activation_bytes`] over the whole
    /// model), or, once its backward ran, the most held at once during a checkpointed
    /// module's recompute if that was more ([`crate::nn::saved_activation_peak`]): their
    /// peak for that step. `param_dtype` bf16/f16 halves them.
    pub activation_bytes: usize,
    /// Most [`activation_bytes`](Self::activation_bytes) seen since the last
    /// [`reset_peak`](Self::reset_peak).
    pub peak_activation_bytes: usize,
}

impl MemoryStats {
    pub(crate) fn on_unshard(&mut self, bytes: usize) {
        self.unsharded_param_bytes += bytes;
        self.unsharded_units += 1;
        self.peak_unsharded_param_bytes = self
            .peak_unsharded_param_bytes
            .max(self.unsharded_param_bytes);
        self.peak_unsharded_units = self.peak_unsharded_units.max(self.unsharded_units);
    }

    pub(crate) fn on_reshard(&mut self, bytes: usize) {
        self.unsharded_param_bytes = self.unsharded_param_bytes.saturating_sub(bytes);
        self.unsharded_units = self.unsharded_units.saturating_sub(1);
    }

    pub(crate) fn on_activations(&mut self, bytes: usize) {
        self.activation_bytes = bytes;
        self.peak_activation_bytes = self.peak_activation_bytes.max(bytes);
    }

    /// The backward's recompute peak ([`crate::nn::saved_activation_peak`]), where above
    /// the end-of-forward figure.
    pub(crate) fn on_recompute_peak(&mut self, bytes: usize) {
        if bytes > self.activation_bytes {
            self.on_activations(bytes);
        }
    }

    /// Starts a new peak window at the current level.
    pub fn reset_peak(&mut self) {
        self.peak_activation_bytes = 0;
        self.peak_unsharded_param_bytes = self.unsharded_param_bytes;
        self.peak_unsharded_units = self.unsharded_units;
    }
}
