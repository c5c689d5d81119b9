//! Auto-wrap policies: which submodules become their own FSDP unit
//! (`torch.distributed.fsdp.wrap`). Policies are applied bottom-up (post-order), so a
//! module is judged after its children have been wrapped, as FSDP1 `_recursive_wrap`.

use crate::nn::{visit_parameters, Module};
use std::collections::HashSet;
use std::sync::Arc;

/// Decides whether `module` (whose not-yet-wrapped parameters number
/// `nonwrapped_numel`) becomes an FSDP unit.
pub type WrapFn = dyn Fn(&dyn Module, usize) -> bool + Send + Sync;

/// An `auto_wrap_policy`.
#[derive(Clone)]
pub enum AutoWrapPolicy {
    /// `transformer_auto_wrap_policy(transformer_layer_cls=...)`: wrap modules whose
    /// [`Module::type_name`] is in the set.
    Transformer(HashSet<String>),
    /// `size_based_auto_wrap_policy(min_num_params)`: wrap a module once the parameters
    /// below it that no nested unit took number at least `min_num_params`.
    SizeBased {
        /// Parameter count (elements, not bytes) at or above which a module is wrapped;
        /// PyTorch's default is 1e8.
        min_num_params: usize,
    },
    /// Any closure `(module, nonwrapped_numel) -> bool`.
    Custom(Arc<WrapFn>),
}

/// `transformer_auto_wrap_policy` over these layer type names (`["Block"]`).
pub fn transformer_auto_wrap_policy<I, S>(layer_types: I) -> AutoWrapPolicy
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    AutoWrapPolicy::Transformer(layer_types.into_iter().map(Into::into).collect())
}

/// `ModuleWrapPolicy(module_classes)`: wrap every module whose type is in the set (FSDP1's
/// class-based policy object; the same rule as [`transformer_auto_wrap_policy`]).
pub fn module_wrap_policy<I, S>(module_types: I) -> AutoWrapPolicy
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    transformer_auto_wrap_policy(module_types)
}

/// `size_based_auto_wrap_policy` with this threshold (PyTorch's default is 1e8).
pub fn size_based_auto_wrap_policy(min_num_params: usize) -> AutoWrapPolicy {
    AutoWrapPolicy::SizeBased { min_num_params }
}

impl AutoWrapPolicy {
    /// Whether `module` should be wrapped.
    pub fn should_wrap(&self, module: &mut dyn Module) -> bool {
        match self {
            AutoWrapPolicy::Transformer(types) => types.contains(module.type_name()),
            AutoWrapPolicy::SizeBased { min_num_params } => {
                nonwrapped_numel(module) >= *min_num_params
            }
            AutoWrapPolicy::Custom(f) => {
                let n = nonwrapped_numel(module);
                f(module, n)
            }
        }
    }
}

/// Parameters below `module` not owned by a nested FSDP unit.
pub fn nonwrapped_numel(module: &mut dyn Module) -> usize {
    let mut n = 0;
    let walked = visit_parameters(module, "", true, &mut |_, p| {
        n += p.numel();
        Ok(())
    });
    // The closure never fails, and a module's walk only passes its errors on.
    debug_assert!(walked.is_ok(), "a module's walk failed: {walked:?}");
    n
}
