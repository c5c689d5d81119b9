//! Collectives on tensors of any device over any group: when the group takes only tensors of
//! one device ([`ProcessGroup::collective_device`], NCCL's GPU), the tensors are copied
//! there, the collective runs, and the outputs are copied back. For the small bookkeeping
//! collectives of training, checkpoints and state dicts (metrics, byte counts, manifests,
//! norms, flags), whose tensors are made on the host; FSDP's own traffic is already on the
//! group's device. PyTorch does the same by hand (`_get_device_from_process_group`, object
//! collectives moving their byte tensors to `torch.cuda.current_device()` for NCCL).

use super::{ProcessGroup, ReduceOp};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// `tensors` on the group's collective device: the originals when they already are (or the
/// group takes any device), else copies.
fn on_group_device(pg: &dyn ProcessGroup, tensors: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    match pg.collective_device() {
        Some(d) if tensors.iter().any(|t| t.device() != d) => Ok(Some(
            tensors
                .iter()
                .map(|t| t.to_device(d))
                .collect::<Result<_>>()?,
        )),
        _ => Ok(None),
    }
}

/// [`ProcessGroup::all_gather_into_tensor`] with `output` and `input` on any device.
///
/// # Errors
/// The collective's errors, and [`crate::Error::Cuda`] when a staging copy fails.
pub fn all_gather_into_tensor(
    pg: &dyn ProcessGroup,
    output: &Tensor,
    input: &Tensor,
) -> Result<()> {
    match on_group_device(pg, &[output, input])? {
        None => pg.all_gather_into_tensor(output, input),
        Some(c) => {
            pg.all_gather_into_tensor(&c[0], &c[1])?;
            output.copy_from(&c[0])
        }
    }
}

/// [`ProcessGroup::all_reduce`] with `tensor` on any device.
///
/// # Errors
/// As [`all_gather_into_tensor`].
pub fn all_reduce(pg: &dyn ProcessGroup, tensor: &Tensor, op: ReduceOp) -> Result<()> {
    match on_group_device(pg, &[tensor])? {
        None => pg.all_reduce(tensor, op),
        Some(c) => {
            pg.all_reduce(&c[0], op)?;
            tensor.copy_from(&c[0])
        }
    }
}

/// [`ProcessGroup::broadcast`] with `tensor` on any device.
///
/// # Errors
/// As [`all_gather_into_tensor`].
pub fn broadcast(pg: &dyn ProcessGroup, tensor: &Tensor, src: usize) -> Result<()> {
    match on_group_device(pg, &[tensor])? {
        None => pg.broadcast(tensor, src),
        Some(c) => {
            pg.broadcast(&c[0], src)?;
            tensor.copy_from(&c[0])
        }
    }
}

/// Every rank's `bytes`, in rank order (a collective over `pg`: two all-gathers, the
/// lengths then the bytes, one byte per int32 word: for manifests and descriptions, which
/// are small).
///
/// # Errors
/// As [`all_gather_into_tensor`].
pub fn all_gather_bytes(pg: &dyn ProcessGroup, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let w = pg.size();
    let len = Tensor::from_vec(vec![bytes.len() as i32], &[1])?;
    let lens = Tensor::zeros(&[w], DType::I32);
    all_gather_into_tensor(pg, &lens, &len)?;
    let lens: Vec<usize> = lens.data::<i32>()?.iter().map(|&l| l as usize).collect();
    let max = lens.iter().copied().max().unwrap_or(0);
    let mut words = vec![0i32; max];
    for (w, &b) in words.iter_mut().zip(bytes) {
        *w = b as i32;
    }
    let mine = Tensor::from_vec(words, &[max])?;
    let all = Tensor::zeros(&[w * max], DType::I32);
    all_gather_into_tensor(pg, &all, &mine)?;
    let v = all.data::<i32>()?;
    Ok((0..w)
        .map(|r| {
            v[r * max..r * max + lens[r]]
                .iter()
                .map(|&x| x as u8)
                .collect()
        })
        .collect())
}
