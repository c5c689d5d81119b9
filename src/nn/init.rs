//! Counter-based parameter initialization: [`InitKey`] (a seed and a module path) makes
//! the [`ParamInit`] of each parameter (defined in the leaf module [`crate::init`]), and
//! [`on_meta_device`] turns them into meta tensors that record it.

use super::torch_rng::TorchGenerator;
use crate::error::Result;
use crate::init::splitmix64;
pub use crate::init::ParamInit;
use crate::tensor::{numel_of, Tensor};
use parking_lot::Mutex;
use std::cell::Cell;
use std::sync::Arc;

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

/// The tensors of a [`ParamInit`] (a trait because `ParamInit` is `fsdp-core`'s, below the
/// on-meta switch of this layer).
pub trait ParamInitExt {
    /// A tensor of `shape` with these values: computed, or a meta tensor recording them
    /// inside [`on_meta_device`].
    ///
    /// # Errors
    /// As [`Tensor::from_vec`].
    fn tensor(&self, shape: &[usize]) -> Result<Tensor>;

    /// A host tensor of `shape` with these values, also inside [`on_meta_device`].
    ///
    /// # Errors
    /// As [`Tensor::from_vec`].
    fn computed(&self, shape: &[usize]) -> Result<Tensor>;
}

impl ParamInitExt for ParamInit {
    fn tensor(&self, shape: &[usize]) -> Result<Tensor> {
        if on_meta() {
            return Ok(Tensor::meta_init(shape, *self));
        }
        self.computed(shape)
    }

    fn computed(&self, shape: &[usize]) -> Result<Tensor> {
        let mut v = vec![0.0f32; numel_of(shape)];
        self.fill(0, &mut v);
        Tensor::from_vec(v, shape)
    }
}

/// Where a module draws its initial values: the seed and the module's path in the model
/// (counter-based, the default: [`InitKey::new`]), or PyTorch's CPU generator shared by the
/// key and its children ([`InitKey::torch`]).
#[derive(Debug, Clone)]
pub struct InitKey {
    seed: u64,
    path: String,
    /// `Some` for [`InitKey::torch`]: every initializer draws from this generator, in the
    /// order the modules are built.
    torch: Option<Arc<Mutex<TorchGenerator>>>,
}

fn fnv1a(s: &str) -> u64 {
    crate::hash::fnv1a(s.as_bytes())
}

impl InitKey {
    /// The root key of a model: counter-based values, a pure function of `(seed, parameter
    /// path, element)`, so a rank can compute its shard alone (the default, and what
    /// deferred init under FSDP uses at any world size).
    pub fn new(seed: u64) -> Self {
        InitKey {
            seed,
            path: String::new(),
            torch: None,
        }
    }

    /// The root key of a model initialized as PyTorch does after `torch.manual_seed(seed)`
    /// on the CPU: the key and all its children draw from one
    /// [`TorchGenerator`](super::TorchGenerator) in the order the initializers are called,
    /// so modules built in the order of a PyTorch script get that script's values
    /// (`Linear`: `kaiming_uniform_(a=sqrt(5))` then the bias; `Embedding`: `normal_`;
    /// `LayerNorm`: ones and zeros, no draw). Opt-in: the values of a parameter depend on
    /// every draw before it, so they are always computed in full, also inside
    /// [`on_meta_device`] (FSDP then shards the computed parameters).
    ///
    /// ```
    /// use fsdp::nn::{InitKey, Linear};
    /// let key = InitKey::torch(0); // torch.manual_seed(0)
    /// let lin = Linear::new(4, 3, true, &key).unwrap(); // nn.Linear(4, 3)
    /// let x = key.randn(&[2, 4]).unwrap(); // torch.randn(2, 4), after the Linear's draws
    /// assert_eq!(lin.weight.data().unwrap().shape(), &[3, 4]);
    /// assert_eq!(x.shape(), &[2, 4]);
    /// ```
    pub fn torch(seed: u64) -> Self {
        InitKey {
            seed,
            path: String::new(),
            torch: Some(Arc::new(Mutex::new(TorchGenerator::manual_seed(seed)))),
        }
    }

    /// The PyTorch generator of a key made by [`InitKey::torch`] (shared with its
    /// children); `None` for a counter-based key.
    pub fn torch_generator(&self) -> Option<&Arc<Mutex<TorchGenerator>>> {
        self.torch.as_ref()
    }

    /// `torch.randn(shape)`, f32, drawn from this key's PyTorch generator after every
    /// initializer called so far; for a counter-based key, N(0, 1) values of the stream
    /// `"randn"` under this key's path (the same on every call).
    ///
    /// # Errors
    /// Never for a valid shape (tensor construction errors are passed on).
    pub fn randn(&self, shape: &[usize]) -> Result<Tensor> {
        match &self.torch {
            Some(g) => g.lock().randn(shape),
            None => ParamInit::Normal {
                stream: self.stream("randn"),
                std: 1.0,
            }
            .computed(shape),
        }
    }

    /// The key of child `name` (`key.child("blocks.0")`); a PyTorch key's child shares its
    /// generator.
    pub fn child(&self, name: &str) -> InitKey {
        InitKey {
            seed: self.seed,
            path: crate::nn::join_name(&self.path, name),
            torch: self.torch.clone(),
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
    /// tensor inside [`on_meta_device`] (computed for a PyTorch key, see [`InitKey::torch`]).
    pub fn normal(&self, name: &str, shape: &[usize], std: f32) -> Result<Tensor> {
        if let Some(g) = &self.torch {
            return g.lock().normal_tensor(shape, 0.0, std as f64);
        }
        ParamInit::Normal {
            stream: self.stream(name),
            std,
        }
        .tensor(shape)
    }

    /// f32 tensor of `shape` with U(-bound, bound) values (`torch.nn.init.uniform_`); a
    /// meta tensor inside [`on_meta_device`] (computed for a PyTorch key).
    pub fn uniform(&self, name: &str, shape: &[usize], bound: f32) -> Result<Tensor> {
        if let Some(g) = &self.torch {
            let b = bound as f64;
            return g.lock().uniform_tensor(shape, -b, b);
        }
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
