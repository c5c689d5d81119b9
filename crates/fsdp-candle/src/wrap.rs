//! Which candle vars form which FSDP unit ([`Wrap`], an auto-wrap policy over var names),
//! and the parameter-only module tree fsdp shards ([`VarTree`]): one node per unit, holding
//! the vars the unit owns under their candle names.

use crate::error::{Error, Result};
use fsdp::nn::{ChildVisitor, Context, Module, ParamVisitor, Parameter};
use fsdp::tensor::Tensor;
use std::sync::Arc;

/// Which module paths of a candle model become FSDP units: PyTorch's `auto_wrap_policy`,
/// over the dotted names a `VarBuilder` gives vars (`"blocks.0.attn.q.weight"` lies in the
/// modules `"blocks"`, `"blocks.0"` and `"blocks.0.attn"`). A var belongs to the innermost
/// unit whose path prefixes its name; vars of no unit belong to the root unit. Units nest
/// when one path prefixes another (`"blocks"` and `"blocks.0"`).
///
/// Each unit is one FlatParameter: gathered and reduced by one collective each, and the
/// granularity at which parameters are sharded and (under full-shard) unsharded. Every rank
/// must give the same policy.
#[derive(Clone)]
pub enum Wrap {
    /// No units besides the root: the whole model is one FlatParameter.
    Root,
    /// These module paths (`["blocks.0", "blocks.1"]`). Each must prefix at least one var
    /// name (a typo is an error, not a silently unsharded block).
    Prefixes(Vec<String>),
    /// Every module path of the model for which the predicate is true, e.g.
    /// `|p| p.starts_with("blocks.") && p.split('.').count() == 2`.
    Modules(Arc<dyn Fn(&str) -> bool + Send + Sync>),
}

impl std::fmt::Debug for Wrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Wrap::Root => write!(f, "Wrap::Root"),
            Wrap::Prefixes(p) => write!(f, "Wrap::Prefixes({p:?})"),
            Wrap::Modules(_) => write!(f, "Wrap::Modules(..)"),
        }
    }
}

impl Wrap {
    /// [`Wrap::Prefixes`] of these paths.
    pub fn prefixes<I, S>(paths: I) -> Wrap
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Wrap::Prefixes(paths.into_iter().map(Into::into).collect())
    }

    /// [`Wrap::Modules`] with this predicate over module paths.
    pub fn modules(f: impl Fn(&str) -> bool + Send + Sync + 'static) -> Wrap {
        Wrap::Modules(Arc::new(f))
    }

    /// The unit paths for a model whose vars are `names` (in the order the builder asked
    /// for them), ordered by the first var each unit holds (a unit before the units nested
    /// in it): the forward order of a model built in forward order.
    ///
    /// # Errors
    /// `InvalidArgument` for an empty or malformed path (`"a..b"`), one given twice, one
    /// that prefixes no var, or a var whose name is a unit's path.
    pub fn units(&self, names: &[String]) -> Result<Vec<String>> {
        for n in names {
            if !well_formed(n) {
                return Err(Error::InvalidArgument(format!(
                    "var name '{n}': give dotted names without empty parts ('blocks.0.weight')"
                )));
            }
        }
        let paths: Vec<String> = match self {
            Wrap::Root => Vec::new(),
            Wrap::Prefixes(p) => p.clone(),
            Wrap::Modules(f) => {
                let mut out: Vec<String> = Vec::new();
                for n in names {
                    let mut at = 0;
                    while let Some(i) = n[at..].find('.') {
                        let path = &n[..at + i];
                        if f(path) && !out.iter().any(|o| o == path) {
                            out.push(path.to_string());
                        }
                        at += i + 1;
                    }
                }
                out
            }
        };
        let mut first = Vec::with_capacity(paths.len());
        for (i, p) in paths.iter().enumerate() {
            if !well_formed(p) {
                return Err(Error::InvalidArgument(format!(
                    "unit path '{p}': give a module path such as 'blocks.0'"
                )));
            }
            if paths[..i].contains(p) {
                return Err(Error::InvalidArgument(format!("unit '{p}' is given twice")));
            }
            if let Some(n) = names.iter().find(|n| *n == p) {
                return Err(Error::InvalidArgument(format!(
                    "var '{n}' has the name of unit '{p}': a unit is a module path, not a var"
                )));
            }
            match names.iter().position(|n| inside(n, p)) {
                Some(at) => first.push((at, p.len(), p.clone())),
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "unit '{p}' holds no var: no var name starts with '{p}.' (the model's modules: {})",
                        module_list(names)
                    )))
                }
            }
        }
        first.sort();
        Ok(first.into_iter().map(|(_, _, p)| p).collect())
    }
}

/// A few of the module paths of `names`, for an error message.
fn module_list(names: &[String]) -> String {
    let mut mods: Vec<&str> = Vec::new();
    for n in names {
        if let Some((m, _)) = n.rsplit_once('.') {
            if !mods.contains(&m) {
                mods.push(m);
            }
        }
    }
    let more = mods.len().saturating_sub(8);
    mods.truncate(8);
    match more {
        0 => mods.join(", "),
        _ => format!("{}, and {more} more", mods.join(", ")),
    }
}

fn well_formed(path: &str) -> bool {
    !path.is_empty() && path.split('.').all(|s| !s.is_empty())
}

/// Whether `name` lies inside module `path` (`"blocks.0.w"` inside `"blocks.0"`, not inside
/// `"blocks.1"` nor `"blocks.01"`).
pub(crate) fn inside(name: &str, path: &str) -> bool {
    name.len() > path.len() && name.starts_with(path) && name.as_bytes()[path.len()] == b'.'
}

/// The innermost unit of `units` that `name` (a var or another unit) lies inside; `""`
/// for the root.
fn owner<'a>(name: &str, units: &'a [String]) -> &'a str {
    units
        .iter()
        .filter(|u| inside(name, u))
        .max_by_key(|u| u.len())
        .map_or("", String::as_str)
}

/// Type name of a unit's node (what the wrap policy picks).
pub(crate) const UNIT_TYPE: &str = "CandleUnit";

/// A node of the tree fsdp shards: the vars one unit owns, under their names relative to
/// the unit (dots allowed: `"attn.q.weight"` in unit `"blocks.0"`), and the units nested
/// in it, under their relative paths. It holds parameters only; candle computes.
pub(crate) struct VarTree {
    path: String,
    params: Vec<(String, Parameter)>,
    children: Vec<(String, Box<dyn Module>)>,
}

impl VarTree {
    /// The root node of `vars` (`(name, values)` in builder order) split into `units`.
    pub(crate) fn build(vars: Vec<(String, Tensor)>, units: &[String]) -> VarTree {
        let mut owned: Vec<(&str, String, Tensor)> = vars
            .into_iter()
            .map(|(n, t)| (owner(&n, units), n, t))
            .collect();
        Self::node("", &mut owned, units)
    }

    fn node(path: &str, vars: &mut Vec<(&str, String, Tensor)>, units: &[String]) -> VarTree {
        let strip = |n: &str| match path.is_empty() {
            true => n.to_string(),
            false => n[path.len() + 1..].to_string(),
        };
        let mut params = Vec::new();
        let mut rest = Vec::new();
        for (o, n, t) in vars.drain(..) {
            match o == path {
                true => params.push((strip(&n), Parameter::new(&strip(&n), t))),
                false => rest.push((o, n, t)),
            }
        }
        *vars = rest;
        let children = units
            .iter()
            .filter(|u| owner(u, units) == path)
            .map(|u| {
                let child: Box<dyn Module> = Box::new(Self::node(u, vars, units));
                (strip(u), child)
            })
            .collect();
        VarTree {
            path: path.to_string(),
            params,
            children,
        }
    }
}

impl Module for VarTree {
    fn type_name(&self) -> &str {
        match self.path.is_empty() {
            true => "CandleRoot",
            false => UNIT_TYPE,
        }
    }

    fn forward(&mut self, _: &Tensor, _: &Context) -> fsdp::Result<Tensor> {
        Err(fsdp::Error::Fsdp(format!(
            "module '{}' holds a candle model's vars; candle computes it (fsdp_candle::CandleFsdp::forward_backward)",
            self.path
        )))
    }

    fn backward(&mut self, g: &Tensor, cx: &Context) -> fsdp::Result<Tensor> {
        self.forward(g, cx)
    }

    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> fsdp::Result<()> {
        for (name, p) in &mut self.params {
            f(name, p)?;
        }
        Ok(())
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> fsdp::Result<()> {
        for (name, c) in &mut self.children {
            f(name, c)?;
        }
        Ok(())
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn units_follow_the_vars_and_nest() {
        let n = names(&[
            "emb.weight",
            "blocks.0.ln.weight",
            "blocks.0.attn.q.weight",
            "blocks.1.ln.weight",
            "blocks.10.ln.weight",
            "head.weight",
        ]);
        let w = Wrap::prefixes(["blocks.10", "blocks.0", "blocks.1", "blocks"]);
        assert_eq!(
            w.units(&n).unwrap(),
            ["blocks", "blocks.0", "blocks.1", "blocks.10"]
        );
        let m = Wrap::modules(|p| p.starts_with("blocks.") && p.split('.').count() == 2);
        assert_eq!(m.units(&n).unwrap(), ["blocks.0", "blocks.1", "blocks.10"]);
        assert_eq!(owner("blocks.10.ln.weight", &names(&["blocks.1"])), "");
        assert_eq!(
            owner("blocks.1.ln.weight", &names(&["blocks", "blocks.1"])),
            "blocks.1"
        );
        let bad = |w: Wrap| w.units(&n).unwrap_err().to_string();
        assert!(bad(Wrap::prefixes(["blocks.2"])).contains("unit 'blocks.2' holds no var"));
        assert!(bad(Wrap::prefixes(["a..b"])).contains("unit path 'a..b'"));
        assert!(bad(Wrap::prefixes(["head", "head"])).contains("given twice"));
        assert!(bad(Wrap::prefixes(["head.weight"])).contains("has the name of unit"));
    }
}
