//! Reaching a rank's units and a unit's parameters: the walks over the units nested in a
//! root ([`FullyShardedDataParallel::for_each_unit`], `with_unit`), over the ignored
//! modules' parameters, and the one that points a unit's original parameters at their
//! views of a gathered buffer or frees them (what unsharding and resharding do to the
//! module).

use super::FullyShardedDataParallel;
use crate::error::{Error, Result};
use crate::nn::{visit_parameters, Module, ParamVisitor, Parameter};
use crate::tensor::Tensor;

/// What [`FullyShardedDataParallel::point`] does to each parameter's data or grad.
#[derive(Clone, Copy)]
pub(super) enum Point<'a> {
    /// Leaves it as it is.
    Keep,
    /// Frees it (`None`).
    Clear,
    /// Points it at its view of this buffer (padded flat layout).
    View(&'a Tensor),
}

/// Runs `f` with a buffer holding `prefix`, kept per thread from call to call, so that the
/// hooks' walks over a unit's parameters (every unit, several times a step) allocate no
/// name (`nn::visit_parameters_in`). A nested call gets a buffer of its own.
fn with_name_buffer<R>(prefix: &str, f: impl FnOnce(&mut String) -> R) -> R {
    thread_local! {
        static NAME: std::cell::Cell<String> = const { std::cell::Cell::new(String::new()) };
    }
    let mut name = NAME.with(std::cell::Cell::take);
    name.clear();
    name.push_str(prefix);
    let r = f(&mut name);
    NAME.with(|c| c.set(name));
    r
}

impl FullyShardedDataParallel {
    /// Points every original parameter's data (or grad) at its view of `buf`, or frees it.
    pub(super) fn point_params(&mut self, buf: Option<&Tensor>, grads: bool) -> Result<()> {
        let to = buf.map_or(Point::Clear, Point::View);
        if grads {
            self.point(Point::Keep, to)
        } else {
            self.point(to, Point::Keep)
        }
    }

    /// [`point_params`](Self::point_params) for the data and the grads in one walk over
    /// the unit's parameters (the hooks walk every unit several times a step).
    pub(super) fn point(&mut self, data: Point<'_>, grad: Point<'_>) -> Result<()> {
        let (slots, rs, flat) = (&self.slots, &self.rs, &self.flat);
        let mut i = 0;
        let walked = with_name_buffer(&self.prefix, |name| {
            crate::nn::visit_parameters_in(
                self.module.as_mut(),
                name,
                true,
                &mut |name, p: &mut Parameter| {
                    if rs.is_ignored(name) {
                        return Ok(());
                    }
                    let Some(&(_, k)) = slots.get(i).filter(|(n, _)| n == name) else {
                        return Err(Error::Fsdp(format!("parameter '{name}' was not flattened into this unit (module changed after wrapping)")));
                    };
                    if p.name() != name {
                        p.set_name(name);
                    }
                    match data {
                        Point::Keep => {}
                        Point::Clear => p.set_data(None)?,
                        Point::View(b) => p.set_data(Some(flat.view(b, k)?))?,
                    }
                    match grad {
                        Point::Keep => {}
                        Point::Clear => p.set_grad(None),
                        Point::View(b) => p.set_grad(Some(flat.view(b, k)?)),
                    }
                    i += 1;
                    Ok(())
                },
            )
        });
        walked?;
        if i != self.slots.len() {
            return Err(Error::Fsdp(format!(
                "unit '{}' flattened {} parameters but its module now has {i}",
                self.prefix,
                self.slots.len()
            )));
        }
        Ok(())
    }

    /// Runs `f` on the unit of module `name` (`""` for the root) among this unit and the
    /// units nested in it: how a host that drives the hooks reaches a nested unit.
    ///
    /// # Errors
    /// `Fsdp` naming `name` when no unit wraps that module.
    pub fn with_unit<R>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> R) -> Result<R> {
        let mut f = Some(f);
        let mut out = None;
        self.each_unit(|u| {
            if u.prefix == name {
                if let Some(f) = f.take() {
                    out = Some(f(u));
                }
            }
        });
        out.ok_or_else(|| Error::Fsdp(format!("no FSDP unit wraps module '{name}'")))
    }

    /// Visits every unit of this rank (self first, then nested units in pre-order).
    ///
    /// # Errors
    /// The first error `f` returns; the units after it are not visited.
    pub fn for_each_unit(&mut self, f: &mut UnitVisitor<'_>) -> Result<()> {
        f(self)?;
        walk_units(self.module.as_mut(), f)
    }

    /// [`for_each_unit`](Self::for_each_unit) with a closure that cannot fail (flags,
    /// figures, lists). A module's walk only passes its visitor's errors on, so none can
    /// arise (checked in debug builds).
    pub(super) fn each_unit(&mut self, mut f: impl FnMut(&mut FullyShardedDataParallel)) {
        let walked = self.for_each_unit(&mut |u| {
            f(u);
            Ok(())
        });
        debug_assert!(walked.is_ok(), "a module's walk failed: {walked:?}");
    }

    /// Runs `f` on every unit, even after one fails (nothing is left half done), and
    /// returns the first error.
    pub(super) fn each_unit_all(
        &mut self,
        mut f: impl FnMut(&mut FullyShardedDataParallel) -> Result<()>,
    ) -> Result<()> {
        let mut first = Ok(());
        self.each_unit(|u| {
            let r = f(u);
            if first.is_ok() {
                first = r;
            }
        });
        first
    }

    /// Visits the parameters of the ignored modules (whole on every rank, FSDP does not
    /// manage them; their gradients are local).
    ///
    /// # Errors
    /// The first error `f` returns; the walk stops there.
    pub fn visit_ignored(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        if self.rs.ignored.is_empty() {
            return Ok(());
        }
        let rs = self.rs.clone();
        let prefix = self.prefix.clone();
        visit_parameters(self.module.as_mut(), &prefix, false, &mut |name, p| {
            if rs.is_ignored(name) {
                f(name, p)
            } else {
                Ok(())
            }
        })
    }

    /// [`visit_ignored`](Self::visit_ignored) with a closure that cannot fail.
    pub(super) fn each_ignored(&mut self, mut f: impl FnMut(&str, &mut Parameter)) {
        let walked = self.visit_ignored(&mut |n, p| {
            f(n, p);
            Ok(())
        });
        debug_assert!(walked.is_ok(), "a module's walk failed: {walked:?}");
    }
}

/// The callback of [`FullyShardedDataParallel::for_each_unit`]; an error stops the walk.
pub type UnitVisitor<'a> = dyn FnMut(&mut FullyShardedDataParallel) -> Result<()> + 'a;

fn walk_units(m: &mut dyn Module, f: &mut UnitVisitor<'_>) -> Result<()> {
    m.for_each_child(&mut |_, child| match child
        .as_any_mut()
        .and_then(|a| a.downcast_mut::<FullyShardedDataParallel>())
    {
        Some(u) => {
            f(u)?;
            walk_units(u.module.as_mut(), f)
        }
        None => walk_units(child.as_mut(), f),
    })
}
