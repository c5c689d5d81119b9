//! The `Module` trait: forward, explicit backward, and parameter/child visiting.
//!
//! No autograd tape: each module saves what its backward needs during `forward` (when
//! [`Context::grad_enabled`]) and `backward` consumes it. Containers call children forward
//! in order and backward in reverse. An FSDP unit is itself a `Module` wrapping another, so
//! FSDP's pre/post hooks are plain code around the inner calls (see `crate::fsdp`).

use super::{FullStateDict, IncompatibleKeys, Parameter};
use crate::error::Result;
use crate::tensor::Tensor;

/// Per-call settings passed down the module tree: two independent switches, as in
/// PyTorch, where `torch.no_grad()` and `model.train(False)` are separate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Context {
    /// Save activations for `backward`. `false` is `torch.no_grad()`.
    pub grad_enabled: bool,
    /// Training mode (`nn.Module.training`, set by `model.train()` / `model.eval()`):
    /// BatchNorm normalizes with the batch's statistics and updates its running stats;
    /// `false` normalizes with the running stats and leaves them alone. Layers without
    /// such a difference ignore it.
    pub training: bool,
}

impl Context {
    /// Training: activations are saved for backward, training mode
    /// (`model.train()` under autograd).
    pub fn train() -> Self {
        Context {
            grad_enabled: true,
            training: true,
        }
    }
    /// Evaluation: `model.eval()` under `torch.no_grad()`: nothing is saved (what an
    /// earlier training forward saved is left for its backward), and BatchNorm uses its
    /// running stats. (Before eval mode existed this was `torch.no_grad()` alone; it only
    /// differs for mode-dependent layers such as [`BatchNorm1d`](super::BatchNorm1d).)
    pub fn eval() -> Self {
        Context {
            grad_enabled: false,
            training: false,
        }
    }
    /// `torch.no_grad()` in training mode: nothing is saved, but BatchNorm still uses and
    /// updates batch statistics.
    pub fn no_grad() -> Self {
        Context {
            grad_enabled: false,
            training: true,
        }
    }
    /// This context with training mode set to `training` (`model.train(training)`).
    pub fn with_training(self, training: bool) -> Self {
        Context { training, ..self }
    }
}

/// The callback of [`Module::for_each_child`]: `(attribute name, child)`; an error stops
/// the walk.
pub type ChildVisitor<'a> = dyn FnMut(&str, &mut Box<dyn Module>) -> Result<()> + 'a;

/// The callback of [`Module::for_each_param`] and [`visit_parameters`]: `(name,
/// parameter)`; an error stops the walk and is returned by it.
pub type ParamVisitor<'a> = dyn FnMut(&str, &mut Parameter) -> Result<()> + 'a;

/// A layer or model with an explicit backward pass (`torch.nn.Module` without autograd).
///
/// A custom layer holds its [`Parameter`]s and lists them in `for_each_param` (and its
/// child modules in `for_each_child`: neither has a default), and computes with
/// [`crate::ops`]:
///
/// ```
/// use fsdp::nn::{no_children, parameter_shapes, ChildVisitor, Context, Module, ParamVisitor, Parameter};
/// use fsdp::{ops, tensor::Tensor, Error, Result};
///
/// /// `y = x * scale`, `scale (C)` broadcast over the rows of `x (.., C)`.
/// struct Scale { scale: Parameter, saved: Option<Tensor> }
///
/// impl Module for Scale {
///     fn type_name(&self) -> &str { "Scale" }
///     fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
///         if cx.grad_enabled { self.saved = Some(x.clone()); }
///         ops::mul(x, self.scale.data()?)
///     }
///     fn backward(&mut self, dy: &Tensor, _: &Context) -> Result<Tensor> {
///         let x = self.saved.take().ok_or(Error::NoSavedForward { module: "Scale" })?;
///         let (dx, ds) = ops::mul_backward(dy, &x, self.scale.data()?)?;
///         if let Some(g) = self.scale.grad_for_accumulate()? { ops::add_(g, &ds)?; }
///         Ok(dx)
///     }
///     fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
///         f("scale", &mut self.scale)
///     }
///     fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> { no_children(f) }
/// }
///
/// let mut m = Scale { scale: Parameter::new("scale", Tensor::from_vec(vec![2.0f32, 3.0], &[2])?), saved: None };
/// let x = Tensor::from_vec(vec![1.0f32, 1.0, 2.0, 2.0], &[2, 2])?;
/// assert_eq!(m.forward(&x, &Context::train())?.to_vec_f32()?, [2.0, 3.0, 4.0, 6.0]);
/// m.backward(&Tensor::from_vec(vec![1.0f32; 4], &[2, 2])?, &Context::train())?;
/// assert_eq!(m.scale.grad().unwrap().to_vec_f32()?, [3.0, 3.0]);
/// assert_eq!(parameter_shapes(&mut m), [("scale".to_string(), vec![2])]);
/// # Ok::<(), fsdp::Error>(())
/// ```
pub trait Module: Send {
    /// Type name used by wrap policies (`transformer_auto_wrap_policy` matches it), e.g.
    /// `"Block"`, `"Linear"`: the class name of the PyTorch module it stands for. The
    /// containers take any name ([`Sequential::with_type_name`](crate::nn::Sequential::with_type_name)).
    fn type_name(&self) -> &str;

    /// Computes the output; saves activations when `cx.grad_enabled`.
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor>;

    /// Given `d loss / d output`, accumulates `d loss / d param` into each parameter's
    /// `grad` (`+=`, as PyTorch accumulates `.grad`) and returns `d loss / d input` (an empty
    /// tensor for integer inputs such as token ids). Consumes the saved activations.
    fn backward(&mut self, grad_out: &Tensor, cx: &Context) -> Result<Tensor>;

    /// Visits the parameters registered directly on this module (not its children's), in
    /// registration order, with their local names (`"weight"`).
    ///
    /// Required, with no default: a module that forgot its parameters would train nothing,
    /// silently. A module without parameters of its own says so with
    /// [`no_params`](crate::nn::no_params) (or `Ok(())`).
    ///
    /// # Errors
    /// The first error `f` returns; the parameters after it are not visited.
    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()>;

    /// Visits the child modules in registration order with their attribute names
    /// (`"blocks.0"`). Children are boxed so a wrap policy can replace one by an FSDP unit.
    ///
    /// Required, with no default (a forgotten child's parameters would never train); a leaf
    /// module says so with [`no_children`](crate::nn::no_children) (or `Ok(())`).
    ///
    /// # Errors
    /// The first error `f` returns; the children after it are not visited.
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()>;

    /// Visits the buffers registered directly on this module (not its children's), in
    /// registration order, with their local names (`"running_mean"`): non-trainable state
    /// (`nn.Module.register_buffer`). The default visits nothing (most layers have none).
    ///
    /// # Errors
    /// The first error `f` returns; the buffers after it are not visited.
    fn for_each_buffer(&mut self, f: &mut super::BufferVisitor<'_>) -> Result<()> {
        let _ = f;
        Ok(())
    }

    /// Pushes the tensors this module (not its children) holds for its backward now:
    /// what its last training forward saved and the backward has not consumed yet. The
    /// default pushes nothing (a layer that saves nothing, or one not accounted for);
    /// [`saved_activation_bytes`](crate::nn::saved_activation_bytes) sums them.
    fn saved_tensors(&self, out: &mut Vec<Tensor>) {
        let _ = out;
    }

    /// True for an FSDP unit: it owns the parameters below it, so an enclosing unit does
    /// not flatten them. Also transparent in names: its child is visited under its own name.
    fn is_fsdp_unit(&self) -> bool {
        false
    }

    /// True for a wrapper that adds no name: its one child is visited under the name `""`,
    /// so the names below it are those the wrapped module had (an FSDP unit, a
    /// [`CheckpointWrapper`](crate::nn::CheckpointWrapper)); [`check_names`] accepts the
    /// empty name there. Defaults to [`is_fsdp_unit`](Self::is_fsdp_unit).
    fn is_name_transparent(&self) -> bool {
        self.is_fsdp_unit()
    }

    /// Downcasting hook: FSDP units return themselves so the root can find nested units,
    /// and the containers ([`Sequential`](super::Sequential), [`ModuleList`](super::ModuleList),
    /// [`ModuleDict`](super::ModuleDict)) so a parent can reach one held as a boxed child
    /// (`dict.get_mut("h")?.as_any_mut()?.downcast_mut::<ModuleList>()`) and run its children.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }

    /// The state dict of a module that keeps its parameters elsewhere (an FSDP root: in
    /// shards), for [`state_dict`](crate::nn::state_dict()); `None` (the default): the
    /// parameters and persistent buffers it visits are its state dict.
    fn state_dict_override(&mut self) -> Option<Result<FullStateDict>> {
        None
    }

    /// The load of such a module, for [`load_state_dict`](crate::nn::load_state_dict);
    /// `sd` holds f32 tensors (and buffers' integer ones). `None` (the default): the
    /// parameters and persistent buffers it visits are loaded.
    fn load_state_dict_override(
        &mut self,
        sd: &FullStateDict,
        strict: bool,
    ) -> Option<Result<IncompatibleKeys>> {
        let _ = (sd, strict);
        None
    }
}

/// The [`Module::for_each_param`] of a module without parameters of its own (`ReLU`, a
/// container): visits nothing.
///
/// ```
/// use fsdp::nn::{no_params, ParamVisitor};
/// let mut seen = 0;
/// let f: &mut ParamVisitor<'_> = &mut |_, _| { seen += 1; Ok(()) };
/// no_params(f).unwrap();
/// assert_eq!(seen, 0);
/// ```
///
/// # Errors
/// None; the `Result` matches the trait method.
pub fn no_params(f: &mut ParamVisitor<'_>) -> Result<()> {
    let _ = f;
    Ok(())
}

/// The [`Module::for_each_child`] of a leaf module: visits nothing.
///
/// # Errors
/// None; the `Result` matches the trait method.
pub fn no_children(f: &mut ChildVisitor<'_>) -> Result<()> {
    let _ = f;
    Ok(())
}

/// Joins a module path and a name with a dot (`"blocks.0" + "weight"`); empty parts vanish.
pub fn join_name(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (true, _) => name.to_string(),
        (_, true) => prefix.to_string(),
        _ => format!("{prefix}.{name}"),
    }
}

/// Visits every parameter below `m` in module pre-order (own parameters, then children in
/// order), as `torch.nn.Module.named_parameters()`, with fully qualified names.
/// `stop_at_units` skips the subtrees of nested FSDP units (not `m` itself): that is the
/// set of parameters a unit flattens (FSDP1 `_get_orig_params` minus nested units).
///
/// # Errors
/// The first error `f` (or a module's own walk) returns; the walk stops there.
pub fn visit_parameters(
    m: &mut dyn Module,
    prefix: &str,
    stop_at_units: bool,
    f: &mut ParamVisitor<'_>,
) -> Result<()> {
    visit_parameters_in(m, &mut prefix.to_string(), stop_at_units, f)
}

/// [`visit_parameters`] with the prefix in `name`, which grows and shrinks as the walk
/// goes (each fully qualified name is [`join_name`]'s) and holds the prefix again after:
/// a caller that keeps the buffer walks without allocating (FSDP's hooks, every unit
/// at every step).
///
/// # Errors
/// As [`visit_parameters`].
pub(crate) fn visit_parameters_in(
    m: &mut dyn Module,
    name: &mut String,
    stop_at_units: bool,
    f: &mut ParamVisitor<'_>,
) -> Result<()> {
    m.for_each_param(&mut |local, p| joined(name, local, |n| f(n, p)))?;
    m.for_each_child(&mut |local, child| {
        if stop_at_units && child.is_fsdp_unit() {
            return Ok(());
        }
        joined(name, local, |n| {
            visit_parameters_in(child.as_mut(), n, stop_at_units, f)
        })
    })
}

/// Runs `f` with `local` appended to the prefix in `name` as [`join_name`] joins them,
/// then cuts `name` back to the prefix.
fn joined<R>(name: &mut String, local: &str, f: impl FnOnce(&mut String) -> R) -> R {
    let len = name.len();
    if !local.is_empty() {
        if len > 0 {
            name.push('.');
        }
        name.push_str(local);
    }
    let r = f(name);
    name.truncate(len);
    r
}

/// [`visit_parameters`] over the whole tree with a closure that cannot fail, for the
/// read-only summaries below. A module's walk only passes its visitor's errors on (every
/// module of this crate), so none can arise; a walk that made one up on its own is cut
/// short where it failed (checked in debug builds).
pub(crate) fn visit_all(m: &mut dyn Module, mut f: impl FnMut(&str, &mut Parameter)) {
    let walked = visit_parameters(m, "", false, &mut |n, p| {
        f(n, p);
        Ok(())
    });
    debug_assert!(walked.is_ok(), "a module's walk failed: {walked:?}");
}

/// Checks the names a module tree gives its parameters, buffers and children, as PyTorch's
/// `register_parameter` / `register_buffer` / `add_module` do
/// (`torch/nn/modules/module.py`): no empty name, and no two parameters or buffers under one
/// fully qualified name (a visitor that names two parameters `"w"`, a buffer like a
/// parameter, or two children `"x"`, would make their state-dict entries collide and a load
/// write one value into both). Subtrees of FSDP units are skipped: they were checked
/// when the unit was made.
///
/// # Errors
/// `InvalidArgument` naming the module path and the offending name.
pub fn check_names(m: &mut dyn Module) -> Result<()> {
    fn walk(
        m: &mut dyn Module,
        prefix: &str,
        seen: &mut std::collections::HashSet<String>,
    ) -> Result<()> {
        let at = |prefix: &str| {
            if prefix.is_empty() {
                "the root module".to_string()
            } else {
                format!("module '{prefix}'")
            }
        };
        m.for_each_param(&mut |name, _| {
            if name.is_empty() {
                crate::error::bail_arg!("{} names a parameter \"\" (empty)", at(prefix));
            }
            let full = join_name(prefix, name);
            if !seen.insert(full.clone()) {
                crate::error::bail_arg!(
                    "{} names two parameters '{full}': each parameter needs a name of its own (PyTorch: attribute '{name}' already exists)",
                    at(prefix)
                );
            }
            Ok(())
        })?;
        m.for_each_buffer(&mut |name, _| {
            if name.is_empty() {
                crate::error::bail_arg!("{} names a buffer \"\" (empty)", at(prefix));
            }
            let full = join_name(prefix, name);
            if !seen.insert(full.clone()) {
                crate::error::bail_arg!(
                    "{} names a buffer '{full}' that is already a parameter or buffer: each needs a name of its own (PyTorch: attribute '{name}' already exists)",
                    at(prefix)
                );
            }
            Ok(())
        })?;
        let transparent = m.is_name_transparent();
        m.for_each_child(&mut |name, child| {
            if name.is_empty() && !transparent {
                crate::error::bail_arg!(
                    "{} names a child module \"\" (PyTorch: module name can't be empty string)",
                    at(prefix)
                );
            }
            if child.is_fsdp_unit() {
                return Ok(());
            }
            walk(child.as_mut(), &join_name(prefix, name), seen)
        })
    }
    walk(m, "", &mut std::collections::HashSet::new())
}

/// The fully qualified name of the first FSDP unit at or below `m` (pre-order), if any.
///
/// # Errors
/// A module's child-visiting error.
pub(crate) fn first_fsdp_unit(m: &mut dyn Module, prefix: &str) -> Result<Option<String>> {
    if m.is_fsdp_unit() {
        return Ok(Some(prefix.to_string()));
    }
    let mut found = None;
    m.for_each_child(&mut |name, child| {
        if found.is_none() {
            found = first_fsdp_unit(child.as_mut(), &join_name(prefix, name))?;
        }
        Ok(())
    })?;
    Ok(found)
}

/// `(fully qualified name, shape)` of every parameter, in `named_parameters()` order.
pub fn parameter_shapes(m: &mut dyn Module) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    visit_all(m, |n, p| out.push((n.to_string(), p.shape().to_vec())));
    out
}

/// Total element count of all parameters below `m`.
pub fn num_parameters(m: &mut dyn Module) -> usize {
    let mut n = 0;
    visit_all(m, |_, p| n += p.numel());
    n
}

/// Drops every parameter's gradient below `m` (`model.zero_grad(set_to_none=True)`).
pub fn zero_grad(m: &mut dyn Module) {
    visit_all(m, |_, p| p.set_grad(None));
}
