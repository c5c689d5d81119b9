//! The ranks' agreement that every rank's local part of a training pass succeeded, before
//! any collective of its backward. The builder, the user's forward/loss closure, reading
//! the loss and candle's backward run on each rank alone; one of them failing on one rank
//! (a loss that is not a scalar, one with no gradient path, the closure's own error) would
//! otherwise leave that rank out of the gradient reductions its peers are already waiting
//! in. So each rank all-gathers one status word after its local part; when any rank
//! failed, the ranks exchange the failures' messages and every rank returns the same
//! [`Error::PassFailed`], having run none of the backward's collectives: nothing changed
//! and the group stays usable for the next step. One 4-byte-a-rank all-gather per pass;
//! the messages move only on failure.

use crate::error::{Error, Result};
use fsdp::distributed::{staged, Group};
use fsdp::tensor::{DType, Tensor};

/// A failure's message is cut to this many bytes (at a character boundary) for the
/// exchange.
const MAX_MESSAGE: usize = 1024;

/// Checks across the ranks of `pg` that every rank's local part of the pass succeeded;
/// `failure` is this rank's error message, `None` when its part succeeded. A collective:
/// every rank calls it once per pass (free on a world of one).
///
/// # Errors
/// [`Error::PassFailed`] on every rank when any rank failed, naming each failed rank and
/// its message; `Fsdp` when a collective fails.
pub(crate) fn every_rank_ok(pg: &Group, failure: Option<String>) -> Result<()> {
    let (w, me) = (pg.size(), pg.rank());
    let failed: Vec<usize> = if w == 1 {
        failure.iter().map(|_| 0).collect()
    } else {
        let word = Tensor::from_vec(vec![i32::from(failure.is_some())], &[1])?;
        let all = Tensor::zeros(&[w], DType::I32);
        staged::all_gather_into_tensor(pg.as_ref(), &all, &word)?;
        let all = all.data::<i32>()?.to_vec();
        (0..w).filter(|&r| all[r] != 0).collect()
    };
    if failed.is_empty() {
        return Ok(());
    }
    let mut mine = failure.unwrap_or_default();
    if mine.len() > MAX_MESSAGE {
        let cut = (0..=MAX_MESSAGE)
            .rev()
            .find(|&i| mine.is_char_boundary(i))
            .unwrap_or(0);
        mine.truncate(cut);
        mine.push_str("...");
    }
    let messages: Vec<String> = match w {
        1 => vec![mine],
        _ => staged::all_gather_bytes(pg.as_ref(), mine.as_bytes())?
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect(),
    };
    let reason: Vec<String> = failed
        .iter()
        .map(|&r| {
            let whose = if r == me { " (this rank)" } else { "" };
            format!("rank {r}{whose}: {}", messages[r])
        })
        .collect();
    Err(Error::PassFailed {
        ranks: failed,
        reason: reason.join("; "),
    })
}
