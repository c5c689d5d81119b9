//! Every rank must declare the same model: the same vars, in the same order, with the same
//! shapes, split into the same units. A rank whose builder differs (another config, a
//! transposed weight of the same size) would otherwise pair its collectives with the wrong
//! parameters. One small all-gather at construction compares fingerprints of the
//! declarations and names the first rank that differs from rank 0 and in what.

use crate::error::{Error, Result};
use fsdp::distributed::Group;
use fsdp::tensor::Tensor;

/// 64-bit FNV-1a of `s`: a fingerprint, not a secret.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What is compared, in the order a difference is reported.
const PARTS: [&str; 3] = ["var names", "var shapes", "units"];

/// Four 16-bit pieces of `h`, each exact as an f32.
fn pieces(h: u64) -> [f32; 4] {
    [0, 16, 32, 48].map(|s| ((h >> s) & 0xffff) as f32)
}

/// Checks across the ranks of `pg` that every rank declared the same `vars` (`(name,
/// shape)` in builder order) and `units`: a collective.
///
/// # Errors
/// `InvalidArgument` naming the first rank that differs from rank 0 and what differs;
/// `Fsdp` when the all-gather fails.
pub(crate) fn same_model(
    pg: &Group,
    vars: &[(String, Vec<usize>)],
    units: &[String],
) -> Result<()> {
    let names: Vec<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
    let shapes: Vec<String> = vars.iter().map(|(_, s)| format!("{s:?}")).collect();
    let hashes = [
        fnv(&names.join("\n")),
        fnv(&shapes.join("\n")),
        fnv(&units.join("\n")),
    ];
    let mut mine = vec![vars.len() as f32];
    for h in hashes {
        mine.extend(pieces(h));
    }
    let w = pg.size();
    let per = mine.len();
    let all = Tensor::zeros(&[w * per], fsdp::tensor::DType::F32);
    pg.all_gather_into_tensor(&all, &Tensor::from_vec(mine, &[per])?)?;
    let all = all.to_vec_f32()?;
    let r0 = &all[..per];
    for r in 1..w {
        let other = &all[r * per..(r + 1) * per];
        if other == r0 {
            continue;
        }
        let what = if other[0] != r0[0] {
            format!("{} vars against rank 0's {}", other[0], r0[0])
        } else {
            let k = (0..PARTS.len())
                .find(|&k| other[1 + 4 * k..5 + 4 * k] != r0[1 + 4 * k..5 + 4 * k])
                .unwrap_or(0);
            format!("other {} than rank 0", PARTS[k])
        };
        return Err(Error::InvalidArgument(format!(
            "rank {r} declares another model than rank 0: {what} (every rank must build the same model, in the same order, with the same Wrap); this rank has {} vars, the first '{}'",
            vars.len(),
            names.first().copied().unwrap_or("")
        )));
    }
    Ok(())
}
