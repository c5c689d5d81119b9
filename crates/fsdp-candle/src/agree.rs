//! Every rank must declare the same model: the same vars, in the same order, with the same
//! shapes, split into the same units. A rank whose builder differs (another config, a
//! transposed weight of the same size) would otherwise pair its collectives with the wrong
//! parameters. One small all-gather at construction compares a hash of each rank's
//! declaration; only when they differ do the ranks exchange the declarations themselves,
//! so that every rank names the same first difference: the var or unit, both ranks and
//! both values (the candle counterpart of fsdp's `embed` declaration check).

use crate::error::{Error, Result};
use fsdp::distributed::{staged, Group};
use fsdp::tensor::{DType, Tensor};

/// 64-bit FNV-1a of `b`: a fingerprint, not a secret.
fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// One declared item, in declaration order: every var, then every unit.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Var { name: String, shape: Vec<usize> },
    Unit(String),
}

impl Entry {
    /// One line of the exchanged declaration (`v <name>\t<d0>,<d1>` or `u <path>`).
    fn encode(&self) -> String {
        match self {
            Entry::Var { name, shape } => {
                let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
                format!("v {name}\t{}", dims.join(","))
            }
            Entry::Unit(u) => format!("u {u}"),
        }
    }

    /// The line [`encode`](Self::encode) wrote; `None` for anything else.
    fn decode(line: &str) -> Option<Entry> {
        if let Some(u) = line.strip_prefix("u ") {
            return Some(Entry::Unit(u.to_string()));
        }
        let (name, dims) = line.strip_prefix("v ")?.rsplit_once('\t')?;
        let shape = match dims {
            "" => Vec::new(),
            d => d
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<_>>()?,
        };
        Some(Entry::Var {
            name: name.to_string(),
            shape,
        })
    }

    fn show(e: Option<&Entry>) -> String {
        match e {
            None => "nothing more".into(),
            Some(Entry::Var { name, shape }) => format!("var '{name}' with shape {shape:?}"),
            Some(Entry::Unit(u)) => format!("unit '{u}'"),
        }
    }
}

/// The declaration as exchanged: one entry a line.
fn encode(entries: &[Entry]) -> Vec<u8> {
    let lines: Vec<String> = entries.iter().map(Entry::encode).collect();
    lines.join("\n").into_bytes()
}

fn decode(b: &[u8]) -> Vec<Entry> {
    String::from_utf8_lossy(b)
        .split('\n')
        .filter(|l| !l.is_empty())
        .filter_map(Entry::decode)
        .collect()
}

/// The first difference between rank 0's declaration `a` and rank `r`'s `b`.
fn first_difference(a: &[Entry], b: &[Entry], r: usize) -> String {
    let at = (0..a.len().max(b.len()))
        .find(|&i| a.get(i) != b.get(i))
        .unwrap_or(0);
    match (a.get(at), b.get(at)) {
        (
            Some(Entry::Var {
                name: na,
                shape: sa,
            }),
            Some(Entry::Var {
                name: nb,
                shape: sb,
            }),
        ) if na == nb => {
            format!("rank {r} built '{nb}' with shape {sb:?}, rank 0 with shape {sa:?}")
        }
        (ea, eb) => {
            let vars = |d: &[Entry]| d.iter().filter(|e| matches!(e, Entry::Var { .. })).count();
            let what = match at < vars(a).max(vars(b)) {
                true => format!("var {at} in builder order"),
                false => format!("unit {}", at - vars(a).min(vars(b))),
            };
            format!(
                "{what}: rank {r} has {}, rank 0 {} ({} vars on rank {r}, {} on rank 0)",
                Entry::show(eb),
                Entry::show(ea),
                vars(b),
                vars(a)
            )
        }
    }
}

/// Checks across the ranks of `pg` that every rank declared the same `vars` (`(name,
/// shape)` in builder order) and `units`: a collective (free on a world of one).
///
/// # Errors
/// `InvalidArgument` naming the first difference between rank 0 and the lowest rank that
/// differs from it (a var by its name and both shapes, or the entries that differ), the
/// same on every rank; `Fsdp` when a collective fails.
pub(crate) fn same_model(
    pg: &Group,
    vars: &[(String, Vec<usize>)],
    units: &[String],
) -> Result<()> {
    if pg.size() == 1 {
        return Ok(());
    }
    let mut entries: Vec<Entry> = vars
        .iter()
        .map(|(name, shape)| Entry::Var {
            name: name.clone(),
            shape: shape.clone(),
        })
        .collect();
    entries.extend(units.iter().cloned().map(Entry::Unit));
    let mine = encode(&entries);
    let h = fnv(&mine);
    // Two 32-bit words, each exact as an i32.
    let hash = Tensor::from_vec(vec![h as u32 as i32, (h >> 32) as u32 as i32], &[2])?;
    let all = Tensor::zeros(&[2 * pg.size()], DType::I32);
    staged::all_gather_into_tensor(pg.as_ref(), &all, &hash)?;
    let all = all.data::<i32>()?.to_vec();
    if all.chunks(2).all(|c| c == &all[..2]) {
        return Ok(());
    }
    let decls: Vec<Vec<Entry>> = staged::all_gather_bytes(pg.as_ref(), &mine)?
        .iter()
        .map(|b| decode(b))
        .collect();
    let Some((r, theirs)) = decls
        .iter()
        .enumerate()
        .skip(1)
        .find(|(_, d)| **d != decls[0])
    else {
        // Equal declarations whose hashes differ cannot happen; say so rather than pass.
        return Err(Error::InvalidArgument(
            "the ranks' declarations hash differently but read the same".into(),
        ));
    };
    Err(Error::InvalidArgument(format!(
        "rank {r} declares another model than rank 0: {} (every rank must build the same model, in the same order, with the same Wrap)",
        first_difference(&decls[0], theirs, r)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn var(name: &str, shape: &[usize]) -> Entry {
        Entry::Var {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn declarations_round_trip_and_their_first_difference_is_named() {
        let a = vec![
            var("l0.weight", &[2, 3]),
            var("l0.b\tias", &[]),
            Entry::Unit("l0".into()),
        ];
        assert_eq!(decode(&encode(&a)), a);
        let mut b = a.clone();
        b[0] = var("l0.weight", &[3, 2]);
        assert_eq!(
            first_difference(&a, &b, 1),
            "rank 1 built 'l0.weight' with shape [3, 2], rank 0 with shape [2, 3]"
        );
        b.remove(0);
        assert_eq!(
            first_difference(&a, &b, 2),
            "var 0 in builder order: rank 2 has var 'l0.b\tias' with shape [], rank 0 var 'l0.weight' with shape [2, 3] (1 vars on rank 2, 2 on rank 0)"
        );
        let mut c = a.clone();
        c[2] = Entry::Unit("l1".into());
        assert_eq!(
            first_difference(&a, &c, 3),
            "unit 0: rank 3 has unit 'l1', rank 0 unit 'l0' (2 vars on rank 3, 2 on rank 0)"
        );
    }
}
