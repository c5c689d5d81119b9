//! Activation checkpointing: a wrapper that keeps only its module's input through the
//! forward and recomputes the module's forward inside its backward (PyTorch's
//! `checkpoint_wrapper` and `apply_activation_checkpointing`,
//! `torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py`, over
//! `torch.utils.checkpoint` with `use_reentrant=False` and `preserve_rng_state=True`).
//!
//! # [Note: what the recompute replays]
//! The recompute must save exactly what the forward would have saved, so that the backward
//! computes the same gradients bit for bit. The forward runs the module with the same
//! training mode and without saving (`Context { grad_enabled: false, .. }`); every layer
//! of this crate computes the same bits with or without grad. State a forward reads and
//! changes lives in buffers ([`Module::for_each_buffer`]: BatchNorm's running stats, and
//! where a layer draws random numbers, its generator state, as PyTorch's checkpoint
//! stashes the RNG state): the wrapper copies its module's buffers before the forward, and
//! around the recompute sets them to that copy and afterwards back to the values they had
//! just before it, so the recompute sees what the forward saw and leaves what the forward
//! left (BatchNorm's stats are updated once, not twice). A module that keeps such state
//! outside buffers (a generator in a plain field) is not replayed.
//!
//! Under FSDP the wrapper sits inside a unit: `FSDP(CheckpointWrapper(Block))`. The unit's
//! backward hook gathers its parameters again (FullShard frees them after forward) before
//! the wrapper's backward, whose recompute then reads them, as FSDP1 with
//! `apply_activation_checkpointing` does. The other order, a wrapper around a unit, would
//! run the unit's forward hooks inside the backward and is refused
//! ([`CheckpointWrapper::new`]); `FullyShardedDataParallel::new` turns
//! `CheckpointWrapper(Block)` into `FSDP(CheckpointWrapper(Block))` when its policy picks
//! the block.

use super::{join_name, ChildVisitor, Context, Module, ModuleDict, ModuleList, ParamVisitor};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::collections::HashSet;
use std::sync::Arc;

/// What the forward keeps for the recompute.
struct Saved {
    /// The module's input.
    input: Tensor,
    /// The forward's training mode.
    training: bool,
    /// Copies of the module's buffers as the forward found them, in visit order.
    buffers: Vec<Tensor>,
}

/// Runs its module's forward without saving activations, keeping only the input; its
/// backward recomputes the forward (saving, this time) and then runs the module's backward
/// (`checkpoint_wrapper(module)`, non-reentrant). Same input, output and gradients as the
/// module alone, bit for bit; see [Note: what the recompute replays].
///
/// Transparent in names, as PyTorch's `CheckpointWrapper` is in state dicts: its module's
/// parameters and buffers keep their names (`blocks.0.attn.c_attn.weight`, no
/// `_checkpoint_wrapped_module` part). Type name `"CheckpointWrapper"`.
///
/// ```
/// use fsdp::nn::{CheckpointWrapper, Context, InitKey, Linear, Module};
/// use fsdp::tensor::Tensor;
/// let mut m = CheckpointWrapper::new(Box::new(Linear::new(3, 2, true, &InitKey::new(0))?))?;
/// let x = Tensor::from_vec(vec![1.0f32; 6], &[2, 3])?;
/// let y = m.forward(&x, &Context::train())?;
/// let dx = m.backward(&Tensor::from_vec(vec![1.0f32; 4], &[2, 2])?, &Context::train())?;
/// assert_eq!((y.shape(), dx.shape()), (&[2, 2][..], &[2, 3][..]));
/// # Ok::<(), fsdp::Error>(())
/// ```
pub struct CheckpointWrapper {
    module: Box<dyn Module>,
    saved: Option<Saved>,
}

impl CheckpointWrapper {
    /// Wraps `module` (`checkpoint_wrapper(module)`).
    ///
    /// # Errors
    /// `InvalidArgument` when checkpointing cannot work on it: it is or holds an FSDP
    /// unit (its recompute would run FSDP's forward hooks inside the backward: checkpoint
    /// the module the unit wraps instead), or it is a [`ModuleList`] / [`ModuleDict`],
    /// which have no forward of their own.
    pub fn new(mut module: Box<dyn Module>) -> Result<Self> {
        check_checkpointable(module.as_mut(), "")?;
        Ok(Self::wrap_checked(module))
    }

    fn wrap_checked(module: Box<dyn Module>) -> Self {
        CheckpointWrapper {
            module,
            saved: None,
        }
    }

    /// The wrapped module.
    pub fn module_mut(&mut self) -> &mut Box<dyn Module> {
        &mut self.module
    }

    /// The wrapped module, unwrapped; what a forward saved is dropped.
    pub fn into_inner(self) -> Box<dyn Module> {
        self.module
    }
}

/// Whether `m` is a [`CheckpointWrapper`].
fn is_checkpoint_wrapper(m: &mut dyn Module) -> bool {
    m.as_any_mut()
        .is_some_and(|a| a.downcast_mut::<CheckpointWrapper>().is_some())
}

/// The refusals of [`CheckpointWrapper::new`], for the module at `fqn`.
fn check_checkpointable(m: &mut dyn Module, fqn: &str) -> Result<()> {
    let at = if fqn.is_empty() {
        format!("a {}", m.type_name())
    } else {
        format!("'{fqn}' ({})", m.type_name())
    };
    let holder = m
        .as_any_mut()
        .is_some_and(|a| a.is::<ModuleList>() || a.is::<ModuleDict>());
    if holder {
        crate::error::bail_arg!(
            "activation checkpointing of {at}: it has no forward of its own (a parent module calls its children), so there is nothing to recompute; checkpoint the modules it holds"
        );
    }
    if let Some(unit) = super::first_fsdp_unit(m, fqn)? {
        let which = if unit == fqn {
            "it is an FSDP unit".to_string()
        } else {
            format!("it holds FSDP unit '{unit}'")
        };
        crate::error::bail_arg!(
            "activation checkpointing of {at}: {which}, whose forward hooks would run again inside the backward; checkpoint the module a unit wraps instead (apply_activation_checkpointing after FullyShardedDataParallel::new does, and FSDP puts its unit around a CheckpointWrapper it is given)"
        );
    }
    Ok(())
}

/// Copies of the buffers below `m`, in visit order.
fn copy_buffers(m: &mut dyn Module) -> Result<Vec<Tensor>> {
    let mut out = Vec::new();
    super::visit_buffers(m, "", false, &mut |_, b| {
        out.push(b.data.deep_clone()?);
        Ok(())
    })?;
    Ok(out)
}

/// Writes `values` (from [`copy_buffers`]) back into the buffers below `m`, in place.
fn set_buffers(m: &mut dyn Module, values: &[Tensor]) -> Result<()> {
    let mut it = values.iter();
    super::visit_buffers(m, "", false, &mut |name, b| {
        let v = it.next().ok_or_else(|| changed_buffers(name))?;
        if v.shape() != b.data.shape() || v.dtype() != b.data.dtype() {
            return Err(changed_buffers(name));
        }
        b.data.copy_from(v)
    })?;
    match it.next() {
        Some(_) => Err(changed_buffers("(one fewer)")),
        None => Ok(()),
    }
}

fn changed_buffers(name: &str) -> Error {
    Error::InvalidArgument(format!(
        "CheckpointWrapper: the module's buffers changed between its forward and its backward (at buffer '{name}'): the recompute cannot replay the forward's state"
    ))
}

impl Module for CheckpointWrapper {
    fn type_name(&self) -> &str {
        "CheckpointWrapper"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        if !cx.grad_enabled {
            return self.module.forward(x, cx);
        }
        let buffers = copy_buffers(self.module.as_mut())?;
        let quiet = Context {
            grad_enabled: false,
            ..*cx
        };
        let y = self.module.forward(x, &quiet)?;
        self.saved = Some(Saved {
            input: x.clone(),
            training: cx.training,
            buffers,
        });
        Ok(y)
    }

    fn backward(&mut self, grad_out: &Tensor, cx: &Context) -> Result<Tensor> {
        let Saved {
            input,
            training,
            buffers,
        } = self.saved.take().ok_or(Error::NoSavedForward {
            module: "CheckpointWrapper",
        })?;
        let m = self.module.as_mut();
        // The recompute: the forward again, saving this time, from the state the forward
        // saw (its buffers), which is then put back as it was.
        let now = if buffers.is_empty() {
            Vec::new()
        } else {
            let now = copy_buffers(m)?;
            set_buffers(m, &buffers)?;
            now
        };
        let replay = Context {
            grad_enabled: true,
            training,
        };
        let recomputed = m.forward(&input, &replay);
        if !now.is_empty() {
            set_buffers(m, &now)?;
        }
        drop(recomputed?);
        super::saved::note_recompute(m)?;
        drop(input);
        m.backward(grad_out, cx)
    }

    fn saved_tensors(&self, out: &mut Vec<Tensor>) {
        if let Some(s) = &self.saved {
            out.push(s.input.clone());
            out.extend(s.buffers.iter().cloned());
        }
    }

    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        super::no_params(f)
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("", &mut self.module)
    }

    fn is_name_transparent(&self) -> bool {
        true
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

/// A [`CheckpointPolicy::Predicate`]: `(fully qualified name, module) -> checkpoint it`.
pub type CheckpointFn = dyn Fn(&str, &dyn Module) -> bool + Send + Sync;

/// The `check_fn` of [`apply_activation_checkpointing`]: which submodules to checkpoint.
#[derive(Clone)]
pub enum CheckpointPolicy {
    /// Modules whose [`Module::type_name`] is in the set (`lambda m: isinstance(m, Block)`).
    Types(HashSet<String>),
    /// Any closure `(fully qualified name, module) -> bool` (PyTorch's `check_fn` takes
    /// the module only).
    Predicate(Arc<CheckpointFn>),
}

impl CheckpointPolicy {
    /// Checkpoint the modules of these type names (`["Block"]`).
    pub fn types<I, S>(names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        CheckpointPolicy::Types(names.into_iter().map(Into::into).collect())
    }

    /// Checkpoint the modules `f(fqn, module)` picks.
    pub fn predicate(f: impl Fn(&str, &dyn Module) -> bool + Send + Sync + 'static) -> Self {
        CheckpointPolicy::Predicate(Arc::new(f))
    }

    fn selects(&self, fqn: &str, m: &dyn Module) -> bool {
        match self {
            CheckpointPolicy::Types(t) => t.contains(m.type_name()),
            CheckpointPolicy::Predicate(f) => f(fqn, m),
        }
    }
}

/// Wraps every submodule of `model` that `policy` selects in a [`CheckpointWrapper`], in
/// place, and returns how many (`apply_activation_checkpointing(model,
/// checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=...)`). Submodules are judged
/// bottom-up, as PyTorch's `_recursive_wrap`, so a selected module inside a selected module
/// is checkpointed twice (nested); `model` itself is never wrapped. The subtree of a
/// `CheckpointWrapper` already there is left alone, so a second call changes nothing.
///
/// Under FSDP call it after `FullyShardedDataParallel::new` (FSDP1's order): it reaches
/// through the units and wraps the modules they hold (`FSDP(CheckpointWrapper(Block))`).
///
/// # Errors
/// `InvalidArgument` when the policy selects a module [`CheckpointWrapper::new`] refuses
/// (an FSDP unit or a module holding one, a `ModuleList` / `ModuleDict`), naming it; the
/// modules wrapped before it stay wrapped, the rest of the model is unchanged.
pub fn apply_activation_checkpointing(
    model: &mut dyn Module,
    policy: &CheckpointPolicy,
) -> Result<usize> {
    fn walk(m: &mut dyn Module, prefix: &str, policy: &CheckpointPolicy) -> Result<usize> {
        let mut n = 0;
        m.for_each_child(&mut |name, child| {
            if is_checkpoint_wrapper(child.as_mut()) {
                return Ok(());
            }
            let fqn = join_name(prefix, name);
            n += walk(child.as_mut(), &fqn, policy)?;
            if policy.selects(&fqn, child.as_ref()) {
                check_checkpointable(child.as_mut(), &fqn)?;
                let inner = std::mem::replace(child, Box::new(super::Sequential::new(Vec::new())));
                *child = Box::new(CheckpointWrapper::wrap_checked(inner));
                n += 1;
            }
            Ok(())
        })?;
        Ok(n)
    }
    walk(model, "", policy)
}
