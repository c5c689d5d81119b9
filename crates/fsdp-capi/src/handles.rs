//! Opaque handles: a process-wide table of objects, each handle an index and a
//! generation. A freed slot gets a new generation before it is reused, so a freed handle
//! (or a copy of it kept by the host) is detected and named, never dereferenced; a handle
//! of one kind passed as another is refused naming both kinds. Handle `0` is the null
//! handle of every kind.
//!
//! A handle is `(generation << 32) | (slot + 1)`. Objects are reference counted: a call
//! clones the object out of the table and releases the table lock before it runs, so a
//! long collective on one rank's model never blocks another rank's calls.

use super::group::GroupObj;
use super::model::ModelObj;
use super::optim::OptimizerObj;
use super::spec::SpecObj;
use super::{Fail, Res, FSDP_ERR_INVALID_HANDLE};
use parking_lot::Mutex;
use std::sync::Arc;

/// A process group (`init_process_group`'s world or a `new_group`); `id == 0` is NULL.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct fsdp_group_t {
    /// Opaque; 0 is the null handle.
    pub id: u64,
}

/// A model declaration being built (units and their parameters); `id == 0` is NULL.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct fsdp_spec_t {
    /// Opaque; 0 is the null handle.
    pub id: u64,
}

/// A built, sharded model (the FSDP root and its units); `id == 0` is NULL.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct fsdp_model_t {
    /// Opaque; 0 is the null handle.
    pub id: u64,
}

/// One FSDP unit of a model (index 0 is the root); valid while its model is. `id == 0` is
/// NULL.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct fsdp_unit_t {
    /// Opaque; 0 is the null handle.
    pub id: u64,
}

/// An optimizer stepping one model's shards; `id == 0` is NULL.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct fsdp_optimizer_t {
    /// Opaque; 0 is the null handle.
    pub id: u64,
}

/// What a slot holds.
#[derive(Clone)]
pub(crate) enum Object {
    Group(Arc<GroupObj>),
    Spec(Arc<Mutex<SpecObj>>),
    Model(Arc<Mutex<ModelObj>>),
    /// Unit `index` of the model `model` (a handle id).
    Unit {
        model: u64,
        index: usize,
    },
    Optimizer(Arc<Mutex<OptimizerObj>>),
}

/// The kinds of handle, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Group,
    Spec,
    Model,
    Unit,
    Optimizer,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Group => "process group (fsdp_group_t)",
            Kind::Spec => "model declaration (fsdp_spec_t)",
            Kind::Model => "model (fsdp_model_t)",
            Kind::Unit => "unit (fsdp_unit_t)",
            Kind::Optimizer => "optimizer (fsdp_optimizer_t)",
        }
    }
}

impl Object {
    fn kind(&self) -> Kind {
        match self {
            Object::Group(_) => Kind::Group,
            Object::Spec(_) => Kind::Spec,
            Object::Model(_) => Kind::Model,
            Object::Unit { .. } => Kind::Unit,
            Object::Optimizer(_) => Kind::Optimizer,
        }
    }
}

struct Slot {
    generation: u32,
    obj: Option<Object>,
}

static TABLE: Mutex<Vec<Slot>> = Mutex::new(Vec::new());

/// Stores `obj` and returns its handle id.
pub(crate) fn insert(obj: Object) -> u64 {
    let mut t = TABLE.lock();
    let at = match t.iter().position(|s| s.obj.is_none()) {
        Some(i) => i,
        None => {
            t.push(Slot {
                generation: 0,
                obj: None,
            });
            t.len() - 1
        }
    };
    let slot = &mut t[at];
    // A new generation per use of the slot: handles of earlier uses stay invalid.
    slot.generation = slot.generation.wrapping_add(1).max(1);
    slot.obj = Some(obj);
    ((slot.generation as u64) << 32) | (at as u64 + 1)
}

fn locate(id: u64, kind: Kind, what: &str) -> Res<(usize, u32)> {
    if id == 0 {
        return Err(Fail::new(
            FSDP_ERR_INVALID_HANDLE,
            format!(
                "{what} is the null {} handle (0): not created, or its creation failed",
                kind.name()
            ),
        ));
    }
    let slot = (id & 0xffff_ffff) as usize;
    let generation = (id >> 32) as u32;
    if slot == 0 || generation == 0 {
        return Err(not_issued(id, kind, what));
    }
    Ok((slot - 1, generation))
}

fn not_issued(id: u64, kind: Kind, what: &str) -> Fail {
    Fail::new(
        FSDP_ERR_INVALID_HANDLE,
        format!(
            "{what} ({id:#x}) is not a {} handle this library issued",
            kind.name()
        ),
    )
}

/// Applies `f` to the live object of handle `id`, which must be of `kind`.
fn with_slot<R>(
    id: u64,
    kind: Kind,
    what: &str,
    f: impl FnOnce(&mut Option<Object>) -> R,
) -> Res<R> {
    let (at, generation) = locate(id, kind, what)?;
    let mut t = TABLE.lock();
    let Some(slot) = t.get_mut(at) else {
        return Err(not_issued(id, kind, what));
    };
    if generation > slot.generation {
        return Err(not_issued(id, kind, what));
    }
    match &slot.obj {
        Some(o) if slot.generation == generation => {
            if o.kind() != kind {
                return Err(Fail::new(
                    FSDP_ERR_INVALID_HANDLE,
                    format!(
                        "{what} is a {} handle, not a {}",
                        o.kind().name(),
                        kind.name()
                    ),
                ));
            }
            Ok(f(&mut slot.obj))
        }
        // An older generation of the slot, or the slot is free now.
        _ => Err(Fail::new(
            FSDP_ERR_INVALID_HANDLE,
            format!(
                "{what} ({id:#x}) is a {} handle that was freed (or destroyed); using it again is an error",
                kind.name()
            ),
        )),
    }
}

/// The object of handle `id` (a clone: the table lock is released on return).
pub(crate) fn get(id: u64, kind: Kind, what: &str) -> Res<Object> {
    with_slot(id, kind, what, |o| o.clone())?
        .ok_or_else(|| Fail::new(FSDP_ERR_INVALID_HANDLE, format!("{what}: empty slot")))
}

/// Frees handle `id` and returns its object.
pub(crate) fn remove(id: u64, kind: Kind, what: &str) -> Res<Object> {
    with_slot(id, kind, what, Option::take)?
        .ok_or_else(|| Fail::new(FSDP_ERR_INVALID_HANDLE, format!("{what}: empty slot")))
}

/// Frees handle `id` if it is still live (no error if it is not: freeing the units of a
/// freed model).
pub(crate) fn remove_quiet(id: u64) {
    let (at, generation) = ((id & 0xffff_ffff) as usize, (id >> 32) as u32);
    if at == 0 {
        return;
    }
    let mut t = TABLE.lock();
    if let Some(slot) = t.get_mut(at - 1) {
        if slot.generation == generation {
            slot.obj = None;
        }
    }
}

/// Whether handle `id` is live (of any kind).
pub(crate) fn is_live(id: u64) -> bool {
    let (at, generation) = ((id & 0xffff_ffff) as usize, (id >> 32) as u32);
    if at == 0 {
        return false;
    }
    let t = TABLE.lock();
    t.get(at - 1)
        .is_some_and(|s| s.generation == generation && s.obj.is_some())
}

macro_rules! getter {
    ($fn:ident, $variant:ident, $kind:ident, $ty:ty) => {
        /// The object of a handle of this kind.
        pub(crate) fn $fn(id: u64, what: &str) -> Res<$ty> {
            match get(id, Kind::$kind, what)? {
                Object::$variant(o) => Ok(o),
                _ => Err(kind_mixup(what)),
            }
        }
    };
}

getter!(group, Group, Group, Arc<GroupObj>);
getter!(spec, Spec, Spec, Arc<Mutex<SpecObj>>);
getter!(model, Model, Model, Arc<Mutex<ModelObj>>);
getter!(optimizer, Optimizer, Optimizer, Arc<Mutex<OptimizerObj>>);

/// `(model handle id, unit index)` of a unit handle.
pub(crate) fn unit(id: u64, what: &str) -> Res<(u64, usize)> {
    match get(id, Kind::Unit, what)? {
        Object::Unit { model, index } => Ok((model, index)),
        _ => Err(kind_mixup(what)),
    }
}

/// `get` checked the kind: an object of another variant is a bug of this module.
fn kind_mixup(what: &str) -> Fail {
    Fail::new(
        super::FSDP_ERR_PANIC,
        format!("{what}: internal: handle kind and object differ"),
    )
}
