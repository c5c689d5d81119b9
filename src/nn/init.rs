//! Counter-based parameter initialization: [`InitKey`] (a seed and a module path) makes
//! the [`ParamInit`] of each parameter (defined in the leaf module [`crate::init`]), and
//! [`on_meta_device`] turns them into meta tensors that record it.

use crate::error::Result;
use crate::init::splitmix64;
pub use crate::init::ParamInit;
use crate::tensor::{numel_of, Tensor};
use std::cell::Cell;

thread_local! {
    static ON_META: Cell<bool> = const { Cell::new(false) };
}

/// Builds modules on `Device::Meta` (`with torch.device("meta"):`): inside `f`, every
/// [`InitKey`] initializer on this thread returns a meta tensor that records how to compute
/// its values ([`ParamInit`]) instead of computing them. FSDP then computes only each
/// rank's shard ([deferred init](crate::fsdp)); [`materialize`](super::materialize)
/// computes a whole module.
pub fn on_meta_device<R>(f: impl FnOnce() -> R) -> R {
    let before = ON_META.with(|m| m.replace(true));
    let out = f();
    ON_META.with(|m| m.set(before));
    out
}

fn on_meta() -> bool {
    ON_META.with(|m| m.get())
}

impl ParamInit {
    /// A tensor of `shape` with these values: computed, or a meta tensor recording them
    /// inside [`on_meta_device`].
    pub fn tensor(&self, shape: &[usize]) -> Result<Tensor> {
        if on_meta() {
            return Ok(Tensor::meta_init(shape, *self));
        }
        let mut v = vec![0.0f32; numel_of(shape)];
        self.fill(0, &mut v);
        Tensor::from_vec(v, shape)
    }
}

/// Where a module draws its initial values: the seed and the module's path in the model.
#[derive(Debug, Clone)]
pub struct InitKey {
    seed: u64,
    path: String,
}

fn fnv1a(s: &str) -> u64 {
    crate::hash::fnv1a(s.as_bytes())
}

impl InitKey {
    /// The root key of a model.
    pub fn new(seed: u64) -> Self {
        InitKey {
            seed,
            path: String::new(),
        }
    }

    /// The key of child `name` (`key.child("blocks.0")`).
    pub fn child(&self, name: &str) -> InitKey {
        InitKey {
            seed: self.seed,
            path: crate::nn::join_name(&self.path, name),
        }
    }

    /// The module path this key stands for.
    pub fn path(&self) -> &str {
        &self.path
    }

    fn stream(&self, name: &str) -> u64 {
        splitmix64(self.seed ^ fnv1a(&crate::nn::join_name(&self.path, name)))
    }

    /// 64 random bits for element `i` of parameter `name`.
    pub fn bits(&self, name: &str, i: u64) -> u64 {
        splitmix64(self.stream(name) ^ splitmix64(i))
    }

    /// Element `i` of the stream `stream` drawn from N(0, std^2).
    pub fn normal_at(&self, stream: u64, i: u64, std: f32) -> f32 {
        ParamInit::Normal { stream, std }.value_at(i)
    }

    /// f32 tensor of `shape` with N(0, std^2) values (`torch.nn.init.normal_`); a meta
    /// tensor inside [`on_meta_device`].
    pub fn normal(&self, name: &str, shape: &[usize], std: f32) -> Result<Tensor> {
        ParamInit::Normal {
            stream: self.stream(name),
            std,
        }
        .tensor(shape)
    }

    /// f32 tensor of `shape` with U(-bound, bound) values (`torch.nn.init.uniform_`); a
    /// meta tensor inside [`on_meta_device`].
    pub fn uniform(&self, name: &str, shape: &[usize], bound: f32) -> Result<Tensor> {
        ParamInit::Uniform {
            stream: self.stream(name),
            bound,
        }
        .tensor(shape)
    }

    /// f32 tensor of `shape` filled with `value`; a meta tensor inside [`on_meta_device`].
    pub fn constant(shape: &[usize], value: f32) -> Result<Tensor> {
        ParamInit::Constant(value).tensor(shape)
    }
}

/// Computes every meta parameter below `m` from its initializer, in place (what
/// `module.to_empty(device)` + `reset_parameters()` do in PyTorch). Tied parameters stay
/// tied.
///
/// # Errors
/// `NotMaterialized` naming a meta parameter without an initializer.
pub fn materialize(m: &mut dyn super::Module) -> Result<()> {
    let mut done: Vec<(Tensor, Tensor)> = Vec::new();
    super::visit_parameters(m, "", false, &mut |name, p| {
        let Ok(d) = p.data() else { return Ok(()) };
        if d.device() != crate::backend::Device::Meta {
            return Ok(());
        }
        let new = match done.iter().find(|(meta, _)| meta.same_view(d)) {
            Some((_, t)) => Ok(t.clone()),
            None => d
                .materialize()
                .inspect(|t| done.push((d.clone(), t.clone()))),
        };
        match new {
            Ok(t) => p.set_data(Some(t)),
            Err(_) => Err(crate::error::Error::NotMaterialized {
                name: name.to_string(),
                state: "meta without an initializer",
            }),
        }
    })
}
