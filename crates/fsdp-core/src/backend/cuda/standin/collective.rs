//! Stand-ins of the threads process group's device collectives (`collective.rs`): each
//! takes a [`Stream`] or an [`Event`], which no build without the `cuda` feature can make.

#![allow(unused_variables, clippy::missing_safety_doc)] // the real names; see the real docs

use super::{Event, Stream};
use crate::error::Result;
use crate::reduce::ReduceOp;
use crate::tensor::DType;

/// Stand-in (see the module docs).
pub fn event_ptr(e: &Event) -> *mut u8 {
    match e.never {}
}

/// Stand-in (see the module docs).
pub unsafe fn wait_event_ptr(s: &Stream, event: *mut u8) -> Result<()> {
    match s.never {}
}

/// Stand-in (see the module docs).
pub unsafe fn copy_bytes(
    s: &Stream,
    dst: u64,
    dst_ordinal: usize,
    src: u64,
    src_ordinal: usize,
    bytes: usize,
) -> Result<()> {
    match s.never {}
}

/// Stand-in (see the module docs).
pub unsafe fn reduce_ranks(
    s: &Stream,
    dtype: DType,
    srcs: &[u64],
    dsts: &[u64],
    n: usize,
    op: ReduceOp,
) -> Result<()> {
    match s.never {}
}
