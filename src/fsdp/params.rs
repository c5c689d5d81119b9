//! What the optimizer and the user see of the parameters outside the hooks: the views of
//! the local shards an optimizer steps on, their names and shapes, and the gathered full
//! parameters (FSDP1 hands the optimizer its sharded `FlatParameter`s;
//! `fully_sharded_data_parallel.py`).

use super::FullyShardedDataParallel;
use crate::distributed::fingerprint::Phase;
use crate::error::Result;
use crate::optim::ParamGrad;
use crate::tensor::{DType, Tensor};

impl FullyShardedDataParallel {
    /// What an optimizer steps on: views of every unit's local shard and gradient shard,
    /// one per trainable parameter with elements on this rank (frozen parameters and
    /// padding excluded, so they are never updated, not even by weight decay); under
    /// NoShard with a [`ZeroRedundancyOptimizer`](super::ZeroRedundancyOptimizer), views of
    /// this rank's optimizer chunk of each whole flat parameter and its gradient; then the
    /// trainable parameters of the ignored modules, whole. The same list at every step;
    /// [`optimizer_param_names`](Self::optimizer_param_names) names its entries.
    pub fn optimizer_params(&mut self) -> Vec<ParamGrad> {
        let mut out = Vec::new();
        self.each_unit(|u| {
            // The optimizer chunk in the local shard (at 0 but under ZeRO-1).
            let at = u.flat.optim_offset();
            for &(start, len) in &u.flat.trainable_runs {
                // Views inside the chunk: in bounds by construction.
                if let Ok(param) = u.flat.local_shard.view(at + start, &[len]) {
                    let grad = u
                        .flat
                        .grad_shard
                        .as_ref()
                        .and_then(|g| g.view(start, &[len]).ok());
                    out.push(ParamGrad { param, grad });
                }
            }
        });
        self.each_ignored(|_, p| {
            if let (true, Ok(param)) = (p.requires_grad, p.data()) {
                out.push(ParamGrad {
                    param: param.clone(),
                    grad: p.grad().cloned(),
                });
            }
        });
        out
    }

    /// The original parameter of each entry of [`optimizer_params`](Self::optimizer_params),
    /// in the same order: its name (as in the state dict) and its whole shape (the entry
    /// holds this rank's elements of it). What parameter groups are built from on each
    /// rank, e.g. [`no_decay_groups`](crate::optim::no_decay_groups) on the shapes.
    ///
    /// ```
    /// use fsdp::distributed::{launch, LaunchOptions};
    /// use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel};
    /// use fsdp::nn::{InitKey, Linear};
    /// use fsdp::optim::{no_decay_groups, AdamConfig, AdamW, Optimizer};
    /// launch(&LaunchOptions::new(2), |pg| {
    ///     let lin = Linear::new(4, 3, true, &InitKey::new(0))?;
    ///     let mut m = FullyShardedDataParallel::new(Box::new(lin), pg, FsdpConfig::default())?;
    ///     let names = m.optimizer_param_names(); // this rank's pieces of weight and bias
    ///     assert_eq!(names.len(), m.optimizer_params().len());
    ///     let shapes: Vec<Vec<usize>> = names.iter().map(|(_, s)| s.clone()).collect();
    ///     let mut opt = AdamW::new(AdamConfig::adamw());
    ///     opt.set_param_groups(no_decay_groups(&shapes, 1e-3, 0.1))
    /// })
    /// .unwrap();
    /// ```
    pub fn optimizer_param_names(&mut self) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        self.each_unit(|u| {
            let (lo, _) = u.flat.optim_range();
            for &(start, _) in &u.flat.trainable_runs {
                // The parameter whose elements start this run (runs are per parameter).
                let at = lo + start;
                let idx = u
                    .flat
                    .infos
                    .iter()
                    .position(|i| i.offset <= at && at < i.offset + i.numel);
                let name = idx.and_then(|k| u.slots.iter().find(|(_, j)| *j == k));
                match (idx, name) {
                    (Some(k), Some((n, _))) => out.push((n.clone(), u.flat.infos[k].shape.clone())),
                    _ => out.push((String::new(), Vec::new())),
                }
            }
        });
        self.each_ignored(|name, p| {
            if let (true, Ok(d)) = (p.requires_grad, p.data()) {
                out.push((name.to_string(), d.shape().to_vec()));
            }
        });
        out
    }

    /// Gathers every unit's full parameters and returns `(name, values)` in
    /// `named_parameters()` order; every rank must call it (it runs collectives).
    pub fn full_parameters(&mut self) -> Result<Vec<(String, Vec<f32>)>> {
        let mut infos = Vec::new();
        self.for_each_unit(&mut |u| {
            let shard = &u.flat.local_shard;
            let full = Tensor::zeros_on(&[u.flat.padded_numel()], DType::F32, shard.device())?;
            if u.rs.strategy.is_sharded() {
                let _tag = u.fingerprint(Phase::StateDict);
                u.rs.shard_pg.all_gather_into_tensor(&full, shard)?;
            } else {
                full.copy_from(shard)?;
            }
            // On the host (a copy when the shards are on a GPU).
            let v = full.to_vec_f32()?;
            for i in &u.flat.infos {
                infos.push((i.fqn.clone(), v[i.offset..i.offset + i.numel].to_vec()));
            }
            Ok(())
        })?;
        self.each_ignored(|name, p| {
            if let Ok(v) = p.data().and_then(|d| d.to_vec_f32()) {
                infos.push((name.to_string(), v));
            }
        });
        // Units are visited root-first; named_parameters() order is module pre-order.
        let order: Vec<String> = crate::nn::parameter_shapes(self)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        infos.sort_by_key(|(n, _)| order.iter().position(|o| o == n).unwrap_or(usize::MAX));
        Ok(infos)
    }
}
