//! `summon_full_params`: whole parameters for the user to read or change through the module
//! (FSDP1 `FullyShardedDataParallel.summon_full_params`, `_unshard_param_utils.py`).

use super::layout::gather_chunk;
use crate::error::Result;
use crate::fsdp::FullyShardedDataParallel;
use crate::tensor::Tensor;

impl FullyShardedDataParallel {
    /// Runs `f` with every parameter of this unit and its nested units whole, f32 (the
    /// master values, whatever the mixed-precision policy), readable and writable through
    /// the module (`module_mut()` and [`visit_parameters`](crate::nn::visit_parameters)),
    /// as `with FSDP.summon_full_params(model, recurse=True, writeback=...)`. With
    /// `writeback`, when `f` returns `Ok`, each rank copies its own chunk of the (possibly
    /// changed) values back into its shard; otherwise changes are discarded. Parameters of
    /// ignored modules are whole anyway and are changed in place.
    ///
    /// A collective: every rank calls it on the same unit (it all-gathers every unit
    /// first, so the whole model is in memory until `f` returns). Forward and backward
    /// inside `f` are refused, and so is `summon_full_params` between a forward and its
    /// backward (as FSDP1 refuses it outside the IDLE state).
    ///
    /// # Errors
    /// `Fsdp` between a forward and its backward or when nested; a collective's error;
    /// whatever `f` returns.
    pub fn summon_full_params<R>(
        &mut self,
        writeback: bool,
        f: impl FnOnce(&mut Self) -> Result<R>,
    ) -> Result<R> {
        self.check_idle("summon_full_params")?;
        let mut bufs: Vec<Tensor> = Vec::new();
        let gathered = self.for_each_unit(&mut |u| {
            let full = gather_chunk(u, u.flat_param().local_shard())?;
            u.rs.mem.lock().on_unshard(full.nbytes());
            bufs.push(full);
            let full = bufs.last().cloned();
            u.point_params(full.as_ref(), false)
        });
        let out = match gathered {
            Ok(()) => {
                self.rs.sched.lock().progress.set_summoning(true);
                let out = f(self);
                self.rs.sched.lock().progress.set_summoning(false);
                out
            }
            Err(e) => Err(e),
        };
        let write = writeback && out.is_ok();
        let mut k = 0;
        // Every gathered unit is restored even after one fails; the first error counts.
        let mut restore: Result<()> = Ok(());
        self.each_unit(|u| {
            let Some(full) = bufs.get(k) else { return };
            k += 1;
            let r = (|| {
                if write {
                    // This rank's chunk of the (changed) values, on the shard's device.
                    let (lo, hi) = u.flat_param().shard_range();
                    u.flat_param()
                        .local_shard()
                        .view(0, &[hi - lo])?
                        .copy_from(&full.view(lo, &[hi - lo])?)?;
                }
                // Back to what the parameters viewed before: the NoShard flat parameter or
                // nothing (sharded).
                let prev = u.rs.sched.lock().full(u.id);
                u.point_params(prev.as_ref(), false)?;
                u.rs.mem.lock().on_reshard(full.nbytes());
                Ok(())
            })();
            if restore.is_ok() {
                restore = r;
            }
        });
        let out = out?;
        restore?;
        Ok(out)
    }
}
