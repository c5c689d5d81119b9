//! The ranks' agreement on a declared model, before anything is built: every rank must
//! pass the same settings that shape the collectives (sharding strategy, hybrid node size,
//! mixed precision, CPU offload, prefetching, `sync_module_states`, the device type) and
//! declare the same units, parameter names, shapes, dtypes and `requires_grad`, in the
//! same order, or the ranks' collectives would not line up (a hybrid rank beside a
//! full-shard one waits for a group that never forms; a transposed shape of the same
//! element count trains wrong silently; units in another order pair the wrong gathers). One all-gather of a 64-bit hash of each rank's declaration (8 bytes a rank)
//! decides; only when the hashes differ do the ranks exchange their declarations, so
//! that every rank reports the same first difference, naming both ranks
//! (`CollectiveMismatch`). FSDP1 has no such check (`_sync_params_and_buffers` compares
//! nothing); this is the embedding counterpart of the collective fingerprints of
//! `distributed::fingerprint`, for the declaration instead of each call.

use super::{ParamSpec, UnitSpec};
use crate::distributed::fingerprint::{self, Fingerprint, Name, Phase};
use crate::distributed::{staged, Group};
use crate::error::{Api, Error, Result};
use crate::fsdp::FsdpConfig;
use crate::tensor::{DType, Tensor};

/// One declared item, in declaration order: the settings first, then the root's
/// parameters (unit `""`), then each unit followed by its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// A setting of the configuration that every rank must give alike: its name and value
    /// in Rust (`FsdpConfig::...`) and in C (`fsdp_config....`, the header's constants; an
    /// empty name where the C ABI has no such field).
    Setting {
        rust: String,
        c: String,
        value: String,
        c_value: String,
    },
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

/// The settings of `config` that the ranks' collectives depend on, in a fixed order.
fn settings(config: &FsdpConfig) -> Vec<Entry> {
    let both = |v: String| (v.clone(), v);
    let strategy = |api: Api| {
        let _api = api.enter();
        config.sharding_strategy.api_name().to_string()
    };
    let precision = match &config.mixed_precision {
        None => ("None".to_string(), "FSDP_PRECISION_F32".to_string()),
        Some(mp) => {
            let d = |t: Option<DType>| t.map_or("None".to_string(), |t| t.to_string());
            let rust = format!(
                "param_dtype {}, reduce_dtype {}, buffer_dtype {}, keep_low_precision_grads {}",
                d(mp.param_dtype),
                d(mp.reduce_dtype),
                d(mp.buffer_dtype),
                mp.keep_low_precision_grads
            );
            let c = match mp.param_dtype {
                Some(DType::BF16) => "FSDP_PRECISION_BF16".to_string(),
                Some(DType::F16) => "FSDP_PRECISION_F16".to_string(),
                _ => rust.clone(),
            };
            (rust, c)
        }
    };
    let prefetch = match config.backward_prefetch {
        None => ("None".to_string(), "FSDP_BACKWARD_PREFETCH_NONE"),
        Some(b @ crate::fsdp::BackwardPrefetch::BackwardPre) => {
            (format!("{b:?}"), "FSDP_BACKWARD_PREFETCH_PRE")
        }
        Some(b @ crate::fsdp::BackwardPrefetch::BackwardPost) => {
            (format!("{b:?}"), "FSDP_BACKWARD_PREFETCH_POST")
        }
    };
    let device = match config.device_id {
        Some(d) if d.is_cuda() => ("cuda".to_string(), "kDLCUDA".to_string()),
        _ => ("cpu".to_string(), "kDLCPU".to_string()),
    };
    let flag = |b: bool| both(b.to_string());
    let entry = |rust: &str, c: &str, (value, c_value): (String, String)| Entry::Setting {
        rust: format!("FsdpConfig::{rust}"),
        c: if c.is_empty() {
            String::new()
        } else {
            format!("fsdp_config.{c}")
        },
        value,
        c_value,
    };
    vec![
        entry(
            "sharding_strategy",
            "sharding_strategy",
            (strategy(Api::Rust), strategy(Api::C)),
        ),
        entry(
            "ranks_per_node",
            "ranks_per_node",
            (
                format!("{:?}", config.ranks_per_node),
                config.ranks_per_node.unwrap_or(0).to_string(),
            ),
        ),
        entry(
            "hybrid_groups",
            "",
            both(
                if config.hybrid_groups.is_some() {
                    "Some"
                } else {
                    "None"
                }
                .to_string(),
            ),
        ),
        entry("mixed_precision", "mixed_precision", precision),
        entry(
            "cpu_offload",
            "cpu_offload",
            flag(config.cpu_offload.offload_params),
        ),
        entry(
            "backward_prefetch",
            "backward_prefetch",
            (prefetch.0, prefetch.1.to_string()),
        ),
        entry(
            "forward_prefetch",
            "forward_prefetch",
            flag(config.forward_prefetch),
        ),
        entry(
            "limit_all_gathers",
            "limit_all_gathers",
            flag(config.limit_all_gathers),
        ),
        entry(
            "sync_module_states",
            "sync_module_states",
            flag(config.sync_module_states),
        ),
        entry("device_id", "device", device),
    ]
}

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
            Entry::Setting {
                rust,
                c,
                value,
                c_value,
            } => {
                b.push(2);
                for s in [rust, c, value, c_value] {
                    put_str(&mut b, s);
                }
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
            2 => Entry::Setting {
                rust: str_of(&mut b)?,
                c: str_of(&mut b)?,
                value: str_of(&mut b)?,
                c_value: str_of(&mut b)?,
            },
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
        Some(Entry::Setting { rust, value, .. }) => format!("{rust} = {value}"),
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
    // Declarations are numbered from the first unit or parameter, after the settings.
    let declared = at
        - a[..at.min(a.len())]
            .iter()
            .filter(|e| matches!(e, Entry::Setting { .. }))
            .count();
    match (a.get(at), b.get(at)) {
        (
            Some(Entry::Setting {
                rust: ra,
                c: ca,
                value: va,
                c_value: cva,
            }),
            Some(Entry::Setting {
                rust: rb,
                value: vb,
                c_value: cvb,
                ..
            }),
        ) if ra == rb => {
            let (name, a, b) = match Api::current() {
                Api::C if !ca.is_empty() => (ca, cva, cvb),
                _ => (ra, va, vb),
            };
            format!("rank {r} passed {name} = {b}, rank 0 {name} = {a}")
        }
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
            "declaration {declared}: rank {r} declared {}, rank 0 {}",
            show(eb),
            show(ea)
        ),
    }
}

/// Checks that every rank of `pg` passed the same collective-shaping settings of `config`
/// and declared `units` and `root` alike (a collective; free on a world of one).
///
/// # Errors
/// `CollectiveMismatch` naming the first difference between rank 0 and the lowest rank
/// that differs from it (a setting by its field name and both values, or a declaration),
/// the same on every rank; the collectives' errors.
pub(super) fn same_on_every_rank(
    pg: &Group,
    config: &FsdpConfig,
    units: &[UnitSpec],
    root: &[ParamSpec],
) -> Result<()> {
    if pg.size() == 1 {
        return Ok(());
    }
    let _tag = fingerprint::enter(Some(Fingerprint {
        unit: Name::new(""),
        phase: Phase::Declaration,
        step: 0,
        micro_batch: 0,
        call: 0,
    }));
    let mut all_entries = settings(config);
    all_entries.extend(entries(units, root));
    let mine = encode(&all_entries);
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
            "the ranks declared different models or configurations: {}; every rank passes the same configuration and declares the same units and parameters (names, shapes, dtypes, requires_grad) in the same order",
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

    #[test]
    fn the_first_differing_setting_is_named_as_the_callers_api_spells_it() {
        use crate::fsdp::{MixedPrecision, ShardingStrategy};
        let full = FsdpConfig::default();
        let hybrid = FsdpConfig {
            sharding_strategy: ShardingStrategy::HybridShard,
            ranks_per_node: Some(1),
            ..FsdpConfig::default()
        };
        let with = |c: &FsdpConfig| {
            let mut e = settings(c);
            e.extend(entries(&[], &[ParamSpec::empty("w", &[2])]));
            e
        };
        let (a, b) = (with(&full), with(&hybrid));
        assert_eq!(decode(&encode(&b)), Some(b.clone()));
        assert_eq!(
            first_difference(&a, &b, 1),
            "rank 1 passed FsdpConfig::sharding_strategy = HybridShard, rank 0 FsdpConfig::sharding_strategy = FullShard"
        );
        {
            let _c = Api::C.enter();
            assert_eq!(
                first_difference(&a, &b, 1),
                "rank 1 passed fsdp_config.sharding_strategy = FSDP_HYBRID_SHARD, rank 0 fsdp_config.sharding_strategy = FSDP_FULL_SHARD"
            );
            let bf16 = FsdpConfig {
                mixed_precision: Some(MixedPrecision::uniform(DType::BF16)),
                ..FsdpConfig::default()
            };
            assert_eq!(
                first_difference(&a, &with(&bf16), 3),
                "rank 3 passed fsdp_config.mixed_precision = FSDP_PRECISION_BF16, rank 0 fsdp_config.mixed_precision = FSDP_PRECISION_F32"
            );
        }
        // Equal settings, then the declarations are compared and numbered from 0.
        let mut c = settings(&full);
        c.extend(entries(&[], &[ParamSpec::empty("v", &[2])]));
        assert_eq!(
            first_difference(&a, &c, 1),
            "declaration 0: rank 1 declared the root parameter 'v' of shape [2], rank 0 the root parameter 'w' of shape [2]"
        );
    }
}
