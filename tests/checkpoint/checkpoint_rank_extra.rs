//! Per-rank extra state in checkpoints (`save_checkpoint_with_rank_extra`): every rank's
//! own value is kept and comes back to that rank; another world size is refused naming
//! both sizes unless the load asks for rank 0's value or none; indexes without per-rank
//! state still load (those of earlier builds, version 1: `tests/checkpoint/checkpoint_compat.rs`).

use crate::common;

use fsdp::checkpoint::{
    load_checkpoint, load_checkpoint_with, read_checkpoint_info, read_index, read_rank_extra,
    save_checkpoint, save_checkpoint_with_rank_extra, RankExtra, INDEX_FILE,
};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel, ShardingStrategy, StateDictType};
use fsdp::optim::{AdamConfig, AdamW, Optimizer};
use fsdp::Error;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-rank-extra-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The uneven 77-parameter model (seed `seed`) wrapped at `pg`'s world size.
fn model(
    pg: Group,
    seed: u64,
    strategy: ShardingStrategy,
) -> fsdp::Result<FullyShardedDataParallel> {
    let world = pg.size();
    let cfg = FsdpConfig {
        sharding_strategy: strategy,
        ranks_per_node: strategy
            .is_hybrid()
            .then(|| common::hybrid_ranks_per_node(world)),
        ..Default::default()
    };
    FullyShardedDataParallel::new(common::uneven_model(seed), pg, cfg)
}

/// What rank `rank` of `world` saves as its own state: distinct on every rank.
fn own_value(rank: usize, world: usize) -> Value {
    json!({"rank": rank, "loader_position": 1000 * world + 17 * rank, "rng": [rank, world, 3]})
}

/// Saves seed 5's model (and an AdamW) at `world` with per-rank values; returns every
/// rank's full parameters.
fn save_at(
    dir: &Path,
    world: usize,
    ty: StateDictType,
    strategy: ShardingStrategy,
) -> Vec<Vec<(String, Vec<f32>)>> {
    launch(&LaunchOptions::new(world), |pg: Group| {
        let rank = pg.rank();
        let mut m = model(pg, 5, strategy)?;
        let opt = AdamW::new(AdamConfig::adamw());
        save_checkpoint_with_rank_extra(
            dir,
            &mut m,
            Some(&opt as &dyn Optimizer),
            ty,
            json!({"step": 7}),
            own_value(rank, world),
        )?;
        m.full_parameters()
    })
    .unwrap()
}

#[test]
fn every_rank_gets_its_own_value_back_at_world_sizes_2_and_4() {
    for (world, ty, strategy) in [
        (2, StateDictType::Sharded, ShardingStrategy::FullShard),
        (2, StateDictType::Full, ShardingStrategy::ShardGradOp),
        (4, StateDictType::Sharded, ShardingStrategy::FullShard),
        // 2 nodes x 2 ranks: the replicas write no file, their values are kept all the same.
        (4, StateDictType::Sharded, ShardingStrategy::HybridShard),
        (4, StateDictType::Full, ShardingStrategy::NoShard),
    ] {
        let what = format!("world {world} {ty:?} {strategy:?}");
        let dir = tmp_dir(&format!("own-{world}-{ty:?}-{strategy:?}"));
        save_at(&dir, world, ty, strategy);
        let index = read_index(&dir).unwrap();
        assert_eq!(index.version, 4, "{what}");
        let want: Vec<Value> = (0..world).map(|r| own_value(r, world)).collect();
        assert_eq!(
            index.rank_extra.as_ref(),
            Some(&want),
            "{what}: the index keeps every rank's value in order"
        );
        assert_eq!(
            index.extra,
            json!({"step": 7}),
            "{what}: the global extra is kept beside them"
        );
        let info = read_checkpoint_info(&dir).unwrap();
        assert!(info.has_rank_extra && info.rank_extra.is_none(), "{what}");
        let got = launch(&LaunchOptions::new(world), |pg: Group| {
            let rank = pg.rank();
            let mut m = model(pg, 6, strategy)?;
            let mut opt = AdamW::new(AdamConfig::adamw());
            let info = load_checkpoint(&dir, &mut m, Some(&mut opt as &mut dyn Optimizer))?;
            let read = read_rank_extra(&dir, rank, world, RankExtra::Own)?;
            Ok((info.rank_extra, read, info.extra, info.has_rank_extra))
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        for (rank, (loaded, read, extra, has)) in got.into_iter().enumerate() {
            assert_eq!(
                loaded,
                Some(own_value(rank, world)),
                "{what}: rank {rank}'s own value"
            );
            assert_eq!(
                read,
                Some(own_value(rank, world)),
                "{what}: read_rank_extra of rank {rank}"
            );
            assert_eq!((extra, has), (json!({"step": 7}), true), "{what}");
        }
    }
}

#[test]
fn another_world_size_is_an_error_naming_both_sizes_and_modifies_nothing() {
    let dir = tmp_dir("mismatch");
    save_at(&dir, 4, StateDictType::Sharded, ShardingStrategy::FullShard);
    for world in [2, 3] {
        let out = launch(&LaunchOptions::new(world), |pg: Group| {
            let mut m = model(pg, 6, ShardingStrategy::FullShard)?;
            let before = m.full_parameters()?;
            let r = load_checkpoint(&dir, &mut m, None);
            Ok((r.map(|i| i.rank_extra), before, m.full_parameters()?))
        })
        .unwrap();
        for (rank, (r, before, after)) in out.into_iter().enumerate() {
            match r {
                Err(Error::Checkpoint { detail, .. }) => assert!(
                    detail.contains("saved at world size 4")
                        && detail.contains(&format!("at world size {world}"))
                        && detail.contains("RankExtra::Rank0"),
                    "world {world} rank {rank}: {detail}"
                ),
                other => panic!("world {world} rank {rank}: {other:?}"),
            }
            assert_eq!(
                before, after,
                "world {world} rank {rank}: the model was modified"
            );
        }
        match read_rank_extra(&dir, 0, world, RankExtra::Own) {
            Err(Error::Checkpoint { detail, .. }) => {
                assert!(
                    detail.contains("world size 4")
                        && detail.contains(&format!("world size {world}")),
                    "{detail}"
                )
            }
            other => panic!("read_rank_extra at world {world}: {other:?}"),
        }
    }
}

#[test]
fn rank0_or_ignore_loads_at_another_world_size() {
    let dir = tmp_dir("rank0");
    let saved = save_at(&dir, 4, StateDictType::Sharded, ShardingStrategy::FullShard);
    for world in [1, 2, 3] {
        for how in [RankExtra::Rank0, RankExtra::Ignore] {
            let got = launch(&LaunchOptions::new(world), |pg: Group| {
                let mut m = model(pg, 6, ShardingStrategy::FullShard)?;
                let mut opt = AdamW::new(AdamConfig::adamw());
                let info =
                    load_checkpoint_with(&dir, &mut m, Some(&mut opt as &mut dyn Optimizer), how)?;
                Ok((info.rank_extra, info.extra, m.full_parameters()?))
            })
            .unwrap_or_else(|e| panic!("world {world} {how:?}: {e}"));
            for (rank, (value, extra, params)) in got.into_iter().enumerate() {
                let want = (how == RankExtra::Rank0).then(|| own_value(0, 4));
                assert_eq!(value, want, "world {world} {how:?} rank {rank}");
                assert_eq!(extra, json!({"step": 7}));
                assert_eq!(
                    params, saved[0],
                    "world {world} {how:?} rank {rank}: the model loaded"
                );
            }
        }
    }
}

#[test]
fn an_index_without_per_rank_state_still_loads_at_any_world_size() {
    // `save_checkpoint` without per-rank state: no `rank_extra` key (as every index of
    // earlier builds), version 4 for its CRC-32 and binding checksums.
    let dir = tmp_dir("old");
    let saved = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = model(pg, 5, ShardingStrategy::FullShard)?;
        save_checkpoint(
            &dir,
            &mut m,
            None,
            StateDictType::Sharded,
            json!({"step": 3}),
        )?;
        m.full_parameters()
    })
    .unwrap();
    let text: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
    let mut keys: Vec<&str> = text
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "checksum_algorithm",
            "extra",
            "files",
            "format",
            "generation",
            "index_checksum",
            "model",
            "optim",
            "state_dict_type",
            "version",
            "world_size"
        ],
        "the fields of an index without per-rank state"
    );
    assert_eq!(text["version"], json!(4));
    assert_eq!(text["checksum_algorithm"], json!("crc32"));
    for world in [2, 3] {
        for how in [RankExtra::Own, RankExtra::Rank0, RankExtra::Ignore] {
            let got = launch(&LaunchOptions::new(world), |pg: Group| {
                let mut m = model(pg, 6, ShardingStrategy::FullShard)?;
                let info = load_checkpoint_with(&dir, &mut m, None, how)?;
                Ok((
                    info.rank_extra,
                    info.has_rank_extra,
                    info.extra,
                    m.full_parameters()?,
                ))
            })
            .unwrap_or_else(|e| panic!("world {world} {how:?}: {e}"));
            for (value, has, extra, params) in got {
                assert_eq!((value, has, extra), (None, false, json!({"step": 3})));
                assert_eq!(params, saved[0]);
            }
        }
    }
}

#[test]
fn ranks_that_disagree_on_per_rank_state_leave_the_previous_checkpoint() {
    let dir = tmp_dir("mixed");
    save_at(&dir, 2, StateDictType::Sharded, ShardingStrategy::FullShard);
    let before = std::fs::read(dir.join(INDEX_FILE)).unwrap();
    let out = launch(&LaunchOptions::new(2), |pg: Group| {
        let rank = pg.rank();
        let mut m = model(pg, 6, ShardingStrategy::FullShard)?;
        let r = if rank == 0 {
            save_checkpoint_with_rank_extra(
                &dir,
                &mut m,
                None,
                StateDictType::Sharded,
                json!({}),
                json!(rank),
            )
        } else {
            save_checkpoint(&dir, &mut m, None, StateDictType::Sharded, json!({}))
        };
        Ok(r.map_err(|e| e.to_string()))
    })
    .unwrap();
    assert!(
        out[0]
            .as_ref()
            .is_err_and(|e| e.contains("ranks [1] saved no per-rank extra state")),
        "{:?}",
        out[0]
    );
    assert!(out[1].is_err(), "rank 1 must fail too: {:?}", out[1]);
    assert_eq!(
        std::fs::read(dir.join(INDEX_FILE)).unwrap(),
        before,
        "the index was replaced"
    );
    // The previous checkpoint still loads with its per-rank values.
    let got = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = model(pg, 6, ShardingStrategy::FullShard)?;
        Ok(load_checkpoint(&dir, &mut m, None)?.rank_extra)
    })
    .unwrap();
    assert_eq!(got, vec![Some(own_value(0, 2)), Some(own_value(1, 2))]);
}

#[test]
fn bad_indexes_are_refused_naming_the_problem() {
    let dir = tmp_dir("bad");
    save_at(&dir, 2, StateDictType::Sharded, ShardingStrategy::FullShard);
    let path = dir.join(INDEX_FILE);
    let good: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let refuse = |edit: &dyn Fn(&mut Value), want: &str| {
        let mut v = good.clone();
        edit(&mut v);
        std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
        match read_index(&dir) {
            Err(Error::Checkpoint { detail, .. }) => assert!(detail.contains(want), "{detail}"),
            other => panic!("want an error containing '{want}': {other:?}"),
        }
    };
    refuse(
        &|v| v["rank_extra"] = json!([1, 2, 3]),
        "per-rank extra state of 3 ranks at world size 2",
    );
    refuse(
        &|v| {
            v["version"] = json!(1);
            v.as_object_mut().unwrap().remove("checksum_algorithm");
        },
        "version 1 with per-rank extra state",
    );
    refuse(&|v| v["version"] = json!(5), "versions 1 to 4");
    refuse(
        &|v| v["checksum_algorithm"] = json!("md5"),
        "version 4 with checksum algorithm 'md5'; this build checks 'crc32'",
    );
    refuse(
        &|v| {
            v.as_object_mut().unwrap().remove("checksum_algorithm");
        },
        "version 4 with checksum algorithm (none)",
    );
    refuse(
        &|v| v["version"] = json!(2),
        "version 2 names checksum algorithm 'crc32', which only version 3 on records",
    );
}

/// A JSON `null` is a per-rank value like any other: saved in its rank's place and given
/// back as `Some(null)`, not mistaken for a rank without per-rank state; a save where every
/// rank's value is `null` keeps them too.
#[test]
fn null_is_a_per_rank_value_saved_and_given_back() {
    for (world, nulls) in [(2, vec![1]), (4, vec![1]), (4, vec![0, 3]), (2, vec![0, 1])] {
        let what = format!("world {world}, null on ranks {nulls:?}");
        let dir = tmp_dir(&format!("null-{world}-{nulls:?}"));
        let value = |rank: usize| {
            if nulls.contains(&rank) {
                Value::Null
            } else {
                own_value(rank, world)
            }
        };
        launch(&LaunchOptions::new(world), |pg: Group| {
            let rank = pg.rank();
            let mut m = model(pg, 5, ShardingStrategy::FullShard)?;
            save_checkpoint_with_rank_extra(
                &dir,
                &mut m,
                None,
                StateDictType::Sharded,
                json!({"step": 7}),
                value(rank),
            )
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let want: Vec<Value> = (0..world).map(value).collect();
        let index = read_index(&dir).unwrap();
        assert_eq!(index.version, 4, "{what}");
        assert_eq!(index.rank_extra.as_ref(), Some(&want), "{what}");
        assert!(read_checkpoint_info(&dir).unwrap().has_rank_extra, "{what}");
        let got = launch(&LaunchOptions::new(world), |pg: Group| {
            let rank = pg.rank();
            let mut m = model(pg, 6, ShardingStrategy::FullShard)?;
            let own = load_checkpoint(&dir, &mut m, None)?.rank_extra;
            let rank0 = load_checkpoint_with(&dir, &mut m, None, RankExtra::Rank0)?.rank_extra;
            let read = read_rank_extra(&dir, rank, world, RankExtra::Own)?;
            Ok((own, rank0, read))
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        for (rank, (own, rank0, read)) in got.into_iter().enumerate() {
            assert_eq!(own, Some(value(rank)), "{what}: rank {rank}");
            assert_eq!(read, Some(value(rank)), "{what}: read_rank_extra {rank}");
            assert_eq!(rank0, Some(value(0)), "{what}: rank 0's value on {rank}");
        }
    }
}
