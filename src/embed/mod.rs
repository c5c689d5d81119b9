//! FSDP for a host framework that keeps its own tensors, compute and autograd (a C++
//! engine, an array library): the host declares each unit by its parameters, fsdp builds
//! and shards the FlatParameters, and the host drives the hooks around its own compute
//! (FSDP2's `fully_shard`, without `torch.nn.Module`; Horovod's split of a small core
//! that owns communication and a host that owns compute). The same runtime as
//! [`FullyShardedDataParallel`] runs underneath: a declared model is an ordinary FSDP root
//! whose modules hold parameters and compute nothing.
//!
//! ```
//! use fsdp::distributed::{launch, LaunchOptions};
//! use fsdp::embed::{fully_shard, ParamSpec, UnitSpec};
//! use fsdp::fsdp::FsdpConfig;
//!
//! launch(&LaunchOptions::new(2), |pg| {
//!     let units = vec![UnitSpec::new("layer0", vec![
//!         ParamSpec::values("weight", &[2, 3], vec![0.5; 6]),
//!         ParamSpec::values("bias", &[2], vec![0.0; 2]),
//!     ])];
//!     let mut model = fully_shard(units, Vec::new(), pg, FsdpConfig::default())?;
//!     // per step: model.pre_forward(true)?;
//!     //   model.with_unit("layer0", |u| { u.pre_forward(true)?; /* compute with
//!     //   u.param_views()? */ u.post_forward(true) })??;  ... model.post_forward(true)?;
//!     // then the backward hooks in reverse and model.finish_backward()?; before the
//!     // optimizer's step, model.ready_for_step()? (what fsdp_optimizer_step checks)
//!     let names: Vec<String> = model.full_parameters()?.into_iter().map(|(n, _)| n).collect();
//!     assert_eq!(names, ["layer0.weight", "layer0.bias"]);
//!     Ok(())
//! })?;
//! # Ok::<(), fsdp::Error>(())
//! ```
//!
//! Every rank must declare the same model: `fully_shard` checks it with one all-gather of
//! a hash of the declaration and names the first difference on every rank. The hooks and
//! their order are documented on [`FullyShardedDataParallel::pre_forward`]; a call out of
//! order is refused (see `fsdp/order.rs`); `tests/fsdp/hooks.rs` trains an MLP computed by
//! plain loops through them.

mod agree;

use crate::distributed::Group;
use crate::error::{Error, Result, Term};
use crate::fsdp::{transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel};
use crate::nn::{join_name, ChildVisitor, Context, Module, ParamInit, ParamVisitor, Parameter};
use crate::tensor::{DType, Tensor};

/// Where a declared parameter's values come from.
#[derive(Debug, Clone)]
pub enum ParamSource {
    /// These values (row-major, `numel` of the shape).
    Values(Vec<f32>),
    /// Computed element by element from the initializer: each rank computes only its
    /// shard (deferred init).
    Init(ParamInit),
    /// No values on this rank: the parameter is on the meta device until
    /// `sync_module_states` gives it rank 0's values (or a `param_init_fn` computes it).
    Empty,
}

/// One parameter of a declared unit: its name within the unit (`"weight"`), shape, f32
/// values (FlatParameters hold f32 master weights; `MixedPrecision` computes in bf16/f16),
/// and whether it trains.
#[derive(Debug, Clone)]
pub struct ParamSpec {
    /// Name within the unit; the fully qualified name is `unit.name`.
    pub name: String,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// False for a frozen parameter: no gradient, never updated.
    pub requires_grad: bool,
    /// Where the values come from.
    pub source: ParamSource,
}

impl ParamSpec {
    /// A trainable parameter with these values.
    pub fn values(name: &str, shape: &[usize], values: Vec<f32>) -> ParamSpec {
        ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            requires_grad: true,
            source: ParamSource::Values(values),
        }
    }

    /// A trainable parameter computed from `init` (deferred, shard by shard).
    pub fn init(name: &str, shape: &[usize], init: ParamInit) -> ParamSpec {
        ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            requires_grad: true,
            source: ParamSource::Init(init),
        }
    }

    /// A trainable parameter without values on this rank (rank 0's, with
    /// `sync_module_states`). A shape with no elements has no values to miss: it is taken
    /// as given (`values` of length 0), with or without `sync_module_states`.
    pub fn empty(name: &str, shape: &[usize]) -> ParamSpec {
        let source = match crate::tensor::numel_of(shape) {
            0 => ParamSource::Values(Vec::new()),
            _ => ParamSource::Empty,
        };
        ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            requires_grad: true,
            source,
        }
    }

    /// The same parameter, frozen.
    pub fn frozen(mut self) -> ParamSpec {
        self.requires_grad = false;
        self
    }

    /// The parameter's element count; `InvalidArgument` naming the parameter (of unit
    /// `unit`) when its element count or its size in bytes as f32 overflows `usize` (no
    /// memory holds it).
    fn numel(&self, unit: &str) -> Result<usize> {
        match crate::tensor::alloc::checked_size(&self.shape, DType::F32) {
            Ok((n, _)) => Ok(n),
            Err(e) => crate::error::bail_arg!("parameter '{}': {e}", join_name(unit, &self.name)),
        }
    }

    fn parameter(self, unit: &str) -> Result<Parameter> {
        let fqn = join_name(unit, &self.name);
        if self.name.is_empty() || self.name.contains('.') {
            crate::error::bail_arg!(
                "parameter name '{}' of unit '{unit}': give a non-empty name without dots (nesting comes from unit names)",
                self.name
            );
        }
        let numel = self.numel(unit)?;
        let data = match self.source {
            ParamSource::Values(v) => {
                if v.len() != numel {
                    crate::error::bail_arg!(
                        "parameter '{fqn}' of shape {:?} needs {numel} values, got {}",
                        self.shape,
                        v.len()
                    );
                }
                Tensor::from_vec(v, &self.shape)?
            }
            ParamSource::Init(init) => Tensor::meta_init(&self.shape, init),
            ParamSource::Empty => Tensor::meta(&self.shape, DType::F32),
        };
        let mut p = Parameter::new(&self.name, data);
        p.requires_grad = self.requires_grad;
        Ok(p)
    }
}

/// A unit the host declares: its module path (`"layers.0"`; dots nest it inside a unit of
/// the path before, if one is declared) and its parameters.
#[derive(Debug, Clone)]
pub struct UnitSpec {
    /// Module path, unique and non-empty (the root is `""`, declared separately).
    pub name: String,
    /// The unit's own parameters, in order.
    pub params: Vec<ParamSpec>,
}

impl UnitSpec {
    /// A unit of module path `name` holding `params`.
    pub fn new(name: &str, params: Vec<ParamSpec>) -> UnitSpec {
        UnitSpec {
            name: name.to_string(),
            params,
        }
    }
}

/// Builds and shards a model the host computes: every unit of `units` becomes its own
/// FSDP unit (nested by path) inside the root, which owns `root_params`. Units flatten and
/// run their collectives in declaration order, so every rank declares the same units in
/// the same order: the ranks check that first, with one all-gather of a hash of their
/// declarations. What `FullyShardedDataParallel::new` does for a module tree, with
/// `config.auto_wrap_policy` replaced by the declared units.
///
/// # Errors
/// `CollectiveMismatch` on every rank when the ranks declared different units,
/// parameter names, shapes, dtypes or `requires_grad`, or another order, naming the
/// first difference and both ranks; `InvalidArgument` for an empty, repeated or
/// malformed name, values that do not fit the shape, a shape no memory holds, a
/// declaration without parameters, or a parameter without values, initializer or a way
/// to get rank 0's; `Fsdp` when `config` names an auto-wrap policy (the units are
/// declared); [`Error::OutOfMemory`] when this rank's shards cannot be allocated; the
/// errors of [`FullyShardedDataParallel::new`].
pub fn fully_shard(
    units: Vec<UnitSpec>,
    root_params: Vec<ParamSpec>,
    pg: Group,
    config: FsdpConfig,
) -> Result<FullyShardedDataParallel> {
    if config.auto_wrap_policy.is_some() {
        return Err(Error::Fsdp(
            "fully_shard: the units are declared; leave FsdpConfig::auto_wrap_policy unset".into(),
        ));
    }
    agree::same_on_every_rank(&pg, &config, &units, &root_params)?;
    // Reported after the names are checked (a malformed name is the first thing to fix).
    let values = check_values(&units, &root_params, &config);
    let mut root = HostModule::new("");
    for p in root_params {
        root.add(p)?;
    }
    for u in units {
        if u.name.is_empty() || u.name.split('.').any(str::is_empty) {
            crate::error::bail_arg!(
                "unit name '{}': give a module path such as 'layers.0'",
                u.name
            );
        }
        root.insert(u)?;
    }
    values?;
    let config = FsdpConfig {
        auto_wrap_policy: Some(transformer_auto_wrap_policy([UNIT_TYPE])),
        ..config
    };
    FullyShardedDataParallel::new(Box::new(root), pg, config)
}

/// Refuses a declaration without any parameter (nothing to shard or train), and a
/// parameter without values on this rank that nothing would give values: no
/// `sync_module_states` to take rank 0's and no `param_init_fn`. Checked before anything
/// is allocated, in the terms of the caller's API.
fn check_values(units: &[UnitSpec], root: &[ParamSpec], config: &FsdpConfig) -> Result<()> {
    let all = || {
        root.iter().map(|p| ("", p)).chain(
            units
                .iter()
                .flat_map(|u| u.params.iter().map(|p| (u.name.as_str(), p))),
        )
    };
    if all().next().is_none() {
        crate::error::bail_arg!(
            "the declaration has no parameters ({} units, none with a parameter): there is nothing to shard or train; declare them with {} or {}",
            units.len(),
            Term::AddParam,
            Term::AddParamInit
        );
    }
    let fed = config.sync_module_states || config.param_init_fn.is_some();
    if let Some((u, p)) = all().find(|(_, p)| matches!(p.source, ParamSource::Empty)) {
        if !fed {
            crate::error::bail_arg!(
                "parameter '{}' has no values on this rank ({}) and nothing gives it any: pass values, use {}, or set {} so that it gets rank 0's",
                join_name(u, &p.name),
                Term::EmptyParam,
                Term::AddParamInit,
                Term::SyncModuleStates
            );
        }
    }
    Ok(())
}

/// Type name of a declared unit's module (what the wrap policy picks).
const UNIT_TYPE: &str = "DeclaredUnit";

/// A module that holds a declared unit's parameters (or only groups children) and computes
/// nothing: the host computes.
struct HostModule {
    /// Full module path.
    path: String,
    /// Declared as a unit (else a plain node on the way to one).
    is_unit: bool,
    /// `(local name, parameter)`: FSDP renames a parameter to its fully qualified name.
    params: Vec<(String, Parameter)>,
    children: Vec<(String, Box<dyn Module>)>,
}

impl HostModule {
    fn new(path: &str) -> HostModule {
        HostModule {
            path: path.to_string(),
            is_unit: false,
            params: Vec::new(),
            children: Vec::new(),
        }
    }

    fn add(&mut self, p: ParamSpec) -> Result<()> {
        if self.params.iter().any(|(n, _)| *n == p.name) {
            crate::error::bail_arg!(
                "parameter '{}' is declared twice",
                join_name(&self.path, &p.name)
            );
        }
        let name = p.name.clone();
        self.params.push((name, p.parameter(&self.path)?));
        Ok(())
    }

    /// Places `u` below this module by its path, creating the nodes on the way.
    fn insert(&mut self, u: UnitSpec) -> Result<()> {
        let rest = match self.path.is_empty() {
            true => u.name.as_str(),
            false => &u.name[self.path.len() + 1..],
        };
        let (head, tail) = match rest.split_once('.') {
            Some((h, t)) => (h, Some(t)),
            None => (rest, None),
        };
        let path = join_name(&self.path, head);
        let at = match self.children.iter().position(|(n, _)| n == head) {
            Some(i) => i,
            None => {
                self.children
                    .push((head.to_string(), Box::new(HostModule::new(&path))));
                self.children.len() - 1
            }
        };
        let child = self.children[at]
            .1
            .as_any_mut()
            .and_then(|a| a.downcast_mut::<HostModule>())
            .ok_or_else(|| {
                Error::Fsdp("internal: a declared module is not a host module".into())
            })?;
        match tail {
            Some(_) => child.insert(u),
            None if child.is_unit => {
                crate::error::bail_arg!("unit '{}' is declared twice", u.name)
            }
            None => {
                child.is_unit = true;
                for p in u.params {
                    child.add(p)?;
                }
                Ok(())
            }
        }
    }
}

impl Module for HostModule {
    fn type_name(&self) -> &str {
        if self.is_unit {
            UNIT_TYPE
        } else {
            "DeclaredModule"
        }
    }

    fn forward(&mut self, _: &Tensor, _: &Context) -> Result<Tensor> {
        Err(Error::Fsdp(format!(
            "module '{}' was declared by a host that computes it: call the unit hooks (pre_forward, post_forward) around the host's own forward",
            self.path
        )))
    }

    fn backward(&mut self, g: &Tensor, cx: &Context) -> Result<Tensor> {
        self.forward(g, cx)
    }

    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        for (name, p) in &mut self.params {
            f(name, p)?;
        }
        Ok(())
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        for (name, c) in &mut self.children {
            f(name, c)?;
        }
        Ok(())
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}
