//! The ranks' agreement on a declared model, before anything is built: every rank must
//! declare the same units, parameter names, shapes, dtypes and `requires_grad`, in the
//! same order, or the FlatParameters of the ranks would not line up (a transposed shape
//! of the same element count trains wrong silently; units in another order pair the wrong
//! gathers). One all-gather of a 64-bit hash of each rank's declaration (8 bytes a rank)
//! decides; only when the hashes differ do the ranks exchange their declarations, so
//! that every rank reports the same first difference, naming both ranks
//! (`CollectiveMismatch`). FSDP1 has no such check (`_sync_params_and_buffers` compares
//! nothing); this is the embedding counterpart of the collective fingerprints of
//! `distributed::fingerprint`, for the declaration instead of each call.

use super::{ParamSpec, UnitSpec};
use crate::distributed::fingerprint::{self, Fingerprint, Name, Phase};
use crate::distributed::{staged, Group};
use crate::error::{Error, Result, Term};
use crate::tensor::{DType, Tensor};

/// One declared item, in declaration order: the root's parameters (unit `""`) first, then
/// each unit followed by its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Unit(String),
    Param {
        unit: String,
        name: String,
        shape: Vec<usize>,
        /// The dtype's name (`"f32"`).
        dtype: String,
        trainable: bool,
    },
}

/// Every declared parameter is f32 (FlatParameters hold f32 master weights).
const DECLARED_DTYPE: DType = DType::F32;

fn entries(units: &[UnitSpec], root: &[ParamSpec]) -> Vec<Entry> {
    let param = |unit: &str, p: &ParamSpec| Entry::Param {
        unit: unit.to_string(),
        name: p.name.clone(),
        shape: p.shape.clone(),
        dtype: DECLARED_DTYPE.to_string(),
        trainable: p.requires_grad,
    };
    let mut out: Vec<Entry> = root.iter().map(|p| param("", p)).collect();
    for u in units {
        out.push(Entry::Unit(u.name.clone()));
        out.extend(u.params.iter().map(|p| param(&u.name, p)));
    }
    out
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// The canonical bytes of a declaration (what is hashed and, on a mismatch, exchanged).
fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut b = Vec::new();
    for e in entries {
        match e {
            Entry::Unit(name) => {
                b.push(0);
                put_str(&mut b, name);
            }
            Entry::Param {
                unit,
                name,
                shape,
                dtype,
                trainable,
            } => {
                b.push(1);
                put_str(&mut b, unit);
                put_str(&mut b, name);
                b.extend_from_slice(&(shape.len() as u64).to_le_bytes());
                for d in shape {
                    b.extend_from_slice(&(*d as u64).to_le_bytes());
                }
                put_str(&mut b, dtype);
                b.push(u8::from(*trainable));
            }
        }
    }
    b
}

/// Reads [`encode`]'s bytes of a peer; `None` for bytes it did not write.
fn decode(mut b: &[u8]) -> Option<Vec<Entry>> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (b.get(..n)?, b.get(n..)?);
        *b = rest;
        Some(head)
    }
    fn u64_of(b: &mut &[u8]) -> Option<u64> {
        Some(u64::from_le_bytes(take(b, 8)?.try_into().ok()?))
    }
    fn str_of(b: &mut &[u8]) -> Option<String> {
        let n = usize::try_from(u64_of(b)?).ok()?;
        String::from_utf8(take(b, n)?.to_vec()).ok()
    }
    let mut out = Vec::new();
    while let Some(&tag) = b.first() {
        b = &b[1..];
        out.push(match tag {
            0 => Entry::Unit(str_of(&mut b)?),
            1 => {
                let unit = str_of(&mut b)?;
                let name = str_of(&mut b)?;
                let ndim = usize::try_from(u64_of(&mut b)?).ok()?;
                let shape = (0..ndim)
                    .map(|_| usize::try_from(u64_of(&mut b)?).ok())
                    .collect::<Option<Vec<usize>>>()?;
                let dtype = str_of(&mut b)?;
                let trainable = *take(&mut b, 1)?.first()? != 0;
                Entry::Param {
                    unit,
                    name,
                    shape,
                    dtype,
                    trainable,
                }
            }
            _ => return None,
        });
    }
    Some(out)
}

fn unit_name(u: &str) -> String {
    match u {
        "" => "the root".to_string(),
        u => format!("unit '{u}'"),
    }
}

/// How a rank's entry reads in a message.
fn show(e: Option<&Entry>) -> String {
    match e {
        None => "nothing more".to_string(),
        Some(Entry::Unit(u)) => unit_name(u),
        Some(Entry::Param {
            unit, name, shape, ..
        }) => format!("{} parameter '{name}' of shape {shape:?}", unit_name(unit)),
    }
}

/// The first difference between rank 0's declaration `a` and rank `r`'s `b`.
fn first_difference(a: &[Entry], b: &[Entry], r: usize) -> String {
    let at = (0..a.len().max(b.len()))
        .find(|&i| a.get(i) != b.get(i))
        .unwrap_or(0);
    match (a.get(at), b.get(at)) {
        (
            Some(Entry::Param {
                unit: ua,
                name: na,
                shape: sa,
                dtype: da,
                trainable: ta,
            }),
            Some(Entry::Param {
                unit: ub,
                name: nb,
                shape: sb,
                dtype: db,
                trainable: tb,
            }),
        ) if ua == ub && na == nb => {
            let what = format!("rank {r} declared {} parameter '{nb}'", unit_name(ub));
            let trainable = |t: &bool| if *t { "trainable" } else { "frozen" };
            if sa != sb {
                format!("{what} with shape {sb:?}, rank 0 with shape {sa:?}")
            } else if da != db {
                format!("{what} as {db}, rank 0 as {da}")
            } else {
                format!("{what} {}, rank 0 {}", trainable(tb), trainable(ta))
            }
        }
        (ea, eb) => format!(
            "declaration {at}: rank {r} declared {}, rank 0 {}",
            show(eb),
            show(ea)
        ),
    }
}

/// Checks that every rank of `pg` declared `units` and `root` alike (a collective; free
/// on a world of one).
///
/// # Errors
/// `CollectiveMismatch` naming the first difference between rank 0 and the lowest rank
/// that differs from it, the same on every rank; the collectives' errors.
pub(super) fn same_on_every_rank(pg: &Group, units: &[UnitSpec], root: &[ParamSpec]) -> Result<()> {
    if pg.size() == 1 {
        return Ok(());
    }
    let _tag = fingerprint::enter(Some(Fingerprint {
        unit: Name::new(""),
        phase: Phase::Init,
        step: 0,
        micro_batch: 0,
        call: 0,
    }));
    let mine = encode(&entries(units, root));
    let h = crate::hash::fnv1a(&mine);
    let words = vec![h as u32 as i32, (h >> 32) as u32 as i32];
    let hash = Tensor::from_vec(words, &[2])?;
    let all = Tensor::zeros(&[2 * pg.size()], DType::I32);
    staged::all_gather_into_tensor(pg.as_ref(), &all, &hash)?;
    let all = all.data::<i32>()?.to_vec();
    if all.chunks(2).all(|c| c == &all[..2]) {
        return Ok(());
    }
    let decls = staged::all_gather_bytes(pg.as_ref(), &mine)?
        .iter()
        .map(|b| decode(b))
        .collect::<Vec<_>>();
    let first = decls.first().cloned().flatten().unwrap_or_default();
    let (r, theirs) = decls
        .iter()
        .enumerate()
        .skip(1)
        .find_map(|(r, d)| match d {
            Some(d) if *d == first => None,
            d => Some((r, d.clone().unwrap_or_default())),
        })
        .unwrap_or((0, first.clone()));
    Err(Error::CollectiveMismatch {
        group_size: pg.size(),
        detail: format!(
            "{}: the ranks declared different models: {}; every rank declares the same units and parameters (names, shapes, dtypes, requires_grad) in the same order",
            Term::BuildModel,
            first_difference(&first, &theirs, r)
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declarations_round_trip_and_their_first_difference_is_named() {
        let p = |n: &str, s: &[usize]| ParamSpec::empty(n, s);
        let units = |order: [&str; 2], w: &[usize]| {
            order
                .iter()
                .map(|u| UnitSpec::new(u, vec![p("weight", w), p("bias", &[3])]))
                .collect::<Vec<_>>()
        };
        let a = entries(&units(["layer0", "layer1"], &[5, 3]), &[p("scale", &[1])]);
        assert_eq!(decode(&encode(&a)), Some(a.clone()));
        assert_eq!(decode(&[1, 2, 3]), None);
        let t = entries(&units(["layer0", "layer1"], &[3, 5]), &[p("scale", &[1])]);
        assert_eq!(
            first_difference(&a, &t, 1),
            "rank 1 declared unit 'layer0' parameter 'weight' with shape [3, 5], rank 0 with shape [5, 3]"
        );
        let o = entries(&units(["layer1", "layer0"], &[5, 3]), &[p("scale", &[1])]);
        assert_eq!(
            first_difference(&a, &o, 3),
            "declaration 1: rank 3 declared unit 'layer1', rank 0 unit 'layer0'"
        );
        let f = entries(
            &units(["layer0", "layer1"], &[5, 3]),
            &[p("scale", &[1]).frozen()],
        );
        assert_eq!(
            first_difference(&a, &f, 1),
            "rank 1 declared the root parameter 'scale' frozen, rank 0 trainable"
        );
        assert_eq!(
            first_difference(&a, &a[..a.len() - 1], 1),
            "declaration 6: rank 1 declared nothing more, rank 0 unit 'layer1' parameter 'bias' of shape [3]"
        );
    }
}
