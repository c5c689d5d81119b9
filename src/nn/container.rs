//! Containers: [`Sequential`] (children run forward in order, backward in reverse),
//! [`ModuleList`] and [`ModuleDict`] (hold children for a parent's own forward), as
//! `torch.nn.Sequential`, `nn.ModuleList` and `nn.ModuleDict`
//! (`torch/nn/modules/container.py`).
//!
//! Children are named as PyTorch names them, so a model built from these containers has
//! PyTorch's `named_parameters()` names: `"0"`, `"1"`, ... by default, or the names given
//! (`nn.Sequential(OrderedDict(...))`, `nn.ModuleDict`), in insertion order. Every
//! container takes a type name ([`Sequential::with_type_name`]) so that a wrap policy
//! (`transformer_auto_wrap_policy(["Block"])`) can match it as it matches a PyTorch class.

use super::{ChildVisitor, Context, Module, ParamVisitor};
use crate::error::{bail_arg, Error, Result};
use crate::tensor::Tensor;

/// Named children in insertion order: what the three containers share.
struct Children {
    names: Vec<String>,
    modules: Vec<Box<dyn Module>>,
    type_name: String,
}

impl Children {
    fn new(type_name: &str) -> Children {
        Children {
            names: Vec::new(),
            modules: Vec::new(),
            type_name: type_name.to_string(),
        }
    }

    /// `nn.Module.add_module`'s checks: a non-empty name without a dot; here also unique.
    fn check_name(&self, name: &str) -> Result<()> {
        if name.is_empty() || name.contains('.') {
            bail_arg!(
                "{}: child name '{name}' must be non-empty and contain no '.' (as nn.Module.add_module requires)",
                self.type_name
            );
        }
        Ok(())
    }

    fn push(&mut self, name: String, m: Box<dyn Module>) -> Result<()> {
        self.check_name(&name)?;
        if self.names.contains(&name) {
            bail_arg!("{}: two children named '{name}'", self.type_name);
        }
        self.names.push(name);
        self.modules.push(m);
        Ok(())
    }

    /// A `dict` assignment: replaces in place, or appends a new name.
    fn insert(&mut self, name: String, m: Box<dyn Module>) -> Result<Option<Box<dyn Module>>> {
        self.check_name(&name)?;
        match self.names.iter().position(|n| *n == name) {
            Some(i) => Ok(Some(std::mem::replace(&mut self.modules[i], m))),
            None => self.push(name, m).map(|()| None),
        }
    }

    fn named<S: Into<String>>(type_name: &str, items: Vec<(S, Box<dyn Module>)>) -> Result<Self> {
        let mut c = Children::new(type_name);
        for (n, m) in items {
            c.push(n.into(), m)?;
        }
        Ok(c)
    }

    fn numbered(type_name: &str, items: Vec<Box<dyn Module>>) -> Self {
        Children {
            names: (0..items.len()).map(|i| i.to_string()).collect(),
            modules: items,
            type_name: type_name.to_string(),
        }
    }

    fn get_mut(&mut self, name: &str) -> Option<&mut Box<dyn Module>> {
        let i = self.names.iter().position(|n| n == name)?;
        self.modules.get_mut(i)
    }

    fn visit(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        for (name, m) in self.names.iter().zip(self.modules.iter_mut()) {
            f(name, m)?;
        }
        Ok(())
    }

    fn no_forward(&self, kind: &str) -> Error {
        Error::InvalidArgument(format!(
            "{} ({kind}) has no forward of its own (as in PyTorch): a parent module calls its children",
            self.type_name
        ))
    }
}

/// Common methods of the containers, stamped out once per type.
macro_rules! container_methods {
    ($t:ident) => {
        impl $t {
            /// Sets the type name wrap policies match ([`Module::type_name`]): the class
            /// name of the PyTorch module this container stands for (`"Block"`).
            pub fn with_type_name(mut self, name: impl Into<String>) -> Self {
                self.c.type_name = name.into();
                self
            }

            /// Number of children.
            pub fn len(&self) -> usize {
                self.c.modules.len()
            }

            /// True without children.
            pub fn is_empty(&self) -> bool {
                self.c.modules.is_empty()
            }

            /// The children's names, in order.
            pub fn names(&self) -> &[String] {
                &self.c.names
            }

            /// The child called `name` (`"0"` for the first of a numbered container).
            pub fn get_mut(&mut self, name: &str) -> Option<&mut Box<dyn Module>> {
                self.c.get_mut(name)
            }

            /// `(name, child)` in order.
            pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut Box<dyn Module>)> {
                self.c
                    .names
                    .iter()
                    .map(String::as_str)
                    .zip(self.c.modules.iter_mut())
            }
        }
    };
}

/// The `Module` of a container that holds children for its parent's forward and has none
/// itself (`nn.ModuleList`, `nn.ModuleDict`: calling one raises `NotImplementedError`).
macro_rules! holder_module {
    ($t:ident) => {
        impl Module for $t {
            fn type_name(&self) -> &str {
                &self.c.type_name
            }
            fn forward(&mut self, _: &Tensor, _: &Context) -> Result<Tensor> {
                Err(self.c.no_forward(stringify!($t)))
            }
            fn backward(&mut self, _: &Tensor, _: &Context) -> Result<Tensor> {
                Err(self.c.no_forward(stringify!($t)))
            }
            fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
                super::no_params(f)
            }
            fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
                self.c.visit(f)
            }
            fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
                Some(self)
            }
        }
    };
}

/// Children run forward in order and backward in reverse (`torch.nn.Sequential`). Named
/// `"0"`, `"1"`, ... ([`Sequential::new`]) or by the names given ([`Sequential::named`],
/// `nn.Sequential(OrderedDict([...]))`).
///
/// ```
/// use fsdp::nn::{parameter_shapes, InitKey, Linear, Module, ReLU, Sequential};
/// let k = InitKey::new(0);
/// let mut m = Sequential::named(vec![
///     ("fc1", Box::new(Linear::new(4, 8, true, &k.child("fc1"))?) as Box<dyn Module>),
///     ("act", Box::new(ReLU::new())),
///     ("fc2", Box::new(Linear::new(8, 2, false, &k.child("fc2"))?)),
/// ])?
/// .with_type_name("Head");
/// let names: Vec<String> = parameter_shapes(&mut m).into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight"]);
/// assert_eq!(m.type_name(), "Head");
/// # Ok::<(), fsdp::Error>(())
/// ```
pub struct Sequential {
    c: Children,
}

impl Sequential {
    /// Children named `"0"`, `"1"`, ... (`nn.Sequential(*layers)`).
    pub fn new(layers: Vec<Box<dyn Module>>) -> Self {
        Sequential {
            c: Children::numbered("Sequential", layers),
        }
    }

    /// Children under the names given, in this order (`nn.Sequential(OrderedDict(...))`).
    ///
    /// # Errors
    /// `InvalidArgument` for an empty name, a name with a `.`, or a name given twice.
    pub fn named<S: Into<String>>(layers: Vec<(S, Box<dyn Module>)>) -> Result<Self> {
        Ok(Sequential {
            c: Children::named("Sequential", layers)?,
        })
    }

    /// Appends `layer` under `name` (`Sequential.add_module`; [`Sequential::new`]'s next
    /// index is `len().to_string()`).
    ///
    /// # Errors
    /// As [`Sequential::named`].
    pub fn push(&mut self, name: impl Into<String>, layer: Box<dyn Module>) -> Result<()> {
        self.c.push(name.into(), layer)
    }
}

container_methods!(Sequential);

impl Module for Sequential {
    fn type_name(&self) -> &str {
        &self.c.type_name
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &mut self.c.modules {
            h = l.forward(&h, cx)?;
        }
        Ok(h)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        let mut g = dy.clone();
        for l in self.c.modules.iter_mut().rev() {
            g = l.backward(&g, cx)?;
        }
        Ok(g)
    }
    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        super::no_params(f)
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        self.c.visit(f)
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

/// Children named `"0"`, `"1"`, ... held for a parent's own forward (`torch.nn.ModuleList`:
/// `self.h = nn.ModuleList([Block() for _ in range(n)])` gives `h.0.*`, `h.1.*`). It has no
/// forward itself.
///
/// ```
/// use fsdp::nn::{parameter_shapes, LayerNorm, Module, ModuleList};
/// let mut h = ModuleList::new(vec![Box::new(LayerNorm::new(3)?), Box::new(LayerNorm::new(3)?)]);
/// h.push(Box::new(LayerNorm::new(3)?));
/// assert_eq!(parameter_shapes(&mut h)[4].0, "2.weight");
/// # Ok::<(), fsdp::Error>(())
/// ```
pub struct ModuleList {
    c: Children,
}

impl ModuleList {
    /// Children named by their index.
    pub fn new(modules: Vec<Box<dyn Module>>) -> Self {
        ModuleList {
            c: Children::numbered("ModuleList", modules),
        }
    }

    /// Appends a child named by its index (`ModuleList.append`).
    pub fn push(&mut self, m: Box<dyn Module>) {
        self.c.names.push(self.c.modules.len().to_string());
        self.c.modules.push(m);
    }

    /// Child `i`.
    pub fn get_index_mut(&mut self, i: usize) -> Option<&mut Box<dyn Module>> {
        self.c.modules.get_mut(i)
    }
}

container_methods!(ModuleList);

holder_module!(ModuleList);

/// Children by name in insertion order, held for a parent's own forward
/// (`torch.nn.ModuleDict`: nanoGPT's `transformer = nn.ModuleDict(dict(wte=..., h=...))`
/// gives `transformer.wte.weight`, `transformer.h.0.*`). It has no forward itself.
///
/// ```
/// use fsdp::nn::{parameter_shapes, InitKey, LayerNorm, Linear, Module, ModuleDict};
/// let mut d = ModuleDict::new(vec![("ln_f", Box::new(LayerNorm::new(3)?) as Box<dyn Module>)])?;
/// d.insert("proj", Box::new(Linear::new(3, 2, false, &InitKey::new(1))?))?;
/// let names: Vec<String> = parameter_shapes(&mut d).into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["ln_f.weight", "ln_f.bias", "proj.weight"]);
/// # Ok::<(), fsdp::Error>(())
/// ```
pub struct ModuleDict {
    c: Children,
}

impl ModuleDict {
    /// Children under these names, in this order.
    ///
    /// # Errors
    /// `InvalidArgument` for an empty name, a name with a `.`, or a name given twice.
    pub fn new<S: Into<String>>(items: Vec<(S, Box<dyn Module>)>) -> Result<Self> {
        Ok(ModuleDict {
            c: Children::named("ModuleDict", items)?,
        })
    }

    /// `d[name] = m`: replaces the child of that name where it stands (returning the old
    /// one), or appends a new name.
    ///
    /// # Errors
    /// `InvalidArgument` for an empty name or a name with a `.`.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        m: Box<dyn Module>,
    ) -> Result<Option<Box<dyn Module>>> {
        self.c.insert(name.into(), m)
    }
}

container_methods!(ModuleDict);

holder_module!(ModuleDict);
