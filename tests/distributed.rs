//! The threads backend's collectives against sequential references, and its failure modes.

mod common;

use fsdp::distributed::{launch, LaunchOptions, ReduceOp};
use fsdp::tensor::{DType, Tensor};
use fsdp::Error;
use std::time::{Duration, Instant};

fn rank_values(rank: usize, n: usize) -> Vec<f32> {
    common::values(rank as u64 + 1, n)
        .iter()
        .map(|v| (v * 8.0).round() / 8.0)
        .collect()
}

#[test]
fn all_gather_and_reduce_scatter_match_sequential_reference() {
    for world in 1..=5 {
        for n in [0usize, 1, 7, 64] {
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::I32] {
                let out = launch(&LaunchOptions::new(world), |pg| {
                    let r = pg.rank();
                    let input = Tensor::from_vec(rank_values(r, n), &[n])?.to_dtype(dtype)?;
                    let gathered = Tensor::zeros(&[n * world], dtype);
                    pg.all_gather_into_tensor(&gathered, &input)?;
                    let big = Tensor::from_vec(rank_values(r, n * world), &[n * world])?
                        .to_dtype(dtype)?;
                    let shard = Tensor::zeros(&[n], dtype);
                    pg.reduce_scatter_tensor(&shard, &big, ReduceOp::Sum)?;
                    let summed = Tensor::from_vec(rank_values(r, n), &[n])?.to_dtype(dtype)?;
                    pg.all_reduce(&summed, ReduceOp::Max)?;
                    Ok((
                        gathered.to_vec_f32()?,
                        shard.to_vec_f32()?,
                        summed.to_vec_f32()?,
                    ))
                })
                .unwrap();
                // Values are multiples of 1/8 in [-8, 8]: exact in every dtype (i32 rounds them).
                let cast = |v: Vec<f32>| {
                    Tensor::from_vec(v.clone(), &[v.len()])
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                        .to_vec_f32()
                        .unwrap()
                };
                let want_gather: Vec<f32> =
                    (0..world).flat_map(|s| cast(rank_values(s, n))).collect();
                for (r, (g, sh, mx)) in out.iter().enumerate() {
                    assert_eq!(
                        g, &want_gather,
                        "all_gather world {world} n {n} {dtype} rank {r}"
                    );
                    let want_shard: Vec<f32> = (0..n)
                        .map(|j| {
                            (0..world)
                                .map(|s| cast(rank_values(s, n * world))[r * n + j])
                                .sum::<f32>()
                        })
                        .collect();
                    assert_eq!(
                        sh,
                        &cast(want_shard),
                        "reduce_scatter world {world} n {n} {dtype} rank {r}"
                    );
                    let want_max: Vec<f32> = (0..n)
                        .map(|j| {
                            (0..world)
                                .map(|s| cast(rank_values(s, n))[j])
                                .fold(f32::MIN, f32::max)
                        })
                        .collect();
                    assert_eq!(mx, &want_max, "all_reduce max world {world} n {n} {dtype}");
                }
            }
        }
    }
}

#[test]
fn all_reduce_ops_and_broadcast() {
    let out = launch(&LaunchOptions::new(3), |pg| {
        let r = pg.rank() as f32;
        let mut res = Vec::new();
        for op in [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Min,
            ReduceOp::Product,
        ] {
            let t = Tensor::from_vec(vec![r + 1.0, 2.0 * r], &[2])?;
            pg.all_reduce(&t, op)?;
            res.push(t.to_vec_f32()?);
        }
        let b = Tensor::from_vec(vec![r; 3], &[3])?;
        pg.broadcast(&b, 2)?;
        res.push(b.to_vec_f32()?);
        pg.barrier()?;
        Ok(res)
    })
    .unwrap();
    for res in out {
        assert_eq!(res[0], vec![6.0, 6.0]);
        assert_eq!(res[1], vec![2.0, 2.0]);
        assert_eq!(res[2], vec![1.0, 0.0]);
        assert_eq!(res[3], vec![6.0, 0.0]);
        assert_eq!(res[4], vec![2.0; 3]);
    }
}

#[test]
fn in_place_all_gather_reads_its_own_chunk() {
    let out = launch(&LaunchOptions::new(2), |pg| {
        let full = Tensor::zeros(&[4], DType::F32);
        let mine = full.view(pg.rank() * 2, &[2])?;
        mine.f32_mut()?
            .copy_from_slice(&[pg.rank() as f32 + 1.0; 2]);
        pg.all_gather_into_tensor(&full, &mine)?;
        full.to_vec_f32()
    })
    .unwrap();
    assert_eq!(out[0], vec![1.0, 1.0, 2.0, 2.0]);
    assert_eq!(out[1], out[0]);
}

#[test]
fn mismatched_sizes_fail_on_every_rank_naming_the_ranks() {
    let err = launch(&LaunchOptions::new(3), |pg| {
        let n = if pg.rank() == 2 { 5 } else { 4 };
        let t = Tensor::zeros(&[n], DType::F32);
        let res = pg.all_reduce(&t, ReduceOp::Sum);
        match res {
            Err(Error::CollectiveMismatch { detail, .. }) => {
                assert!(detail.contains("rank 2"), "{detail}");
                Err::<(), Error>(Error::CollectiveMismatch {
                    group_size: 3,
                    detail,
                })
            }
            other => panic!(
                "rank {} expected a mismatch error, got {other:?}",
                pg.rank()
            ),
        }
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("rank 2 called all_reduce(f32, 5 -> 5"),
        "{err}"
    );
}

#[test]
fn mismatched_ops_are_reported() {
    let err = launch(&LaunchOptions::new(2), |pg| {
        let t = Tensor::zeros(&[2], DType::F32);
        if pg.rank() == 0 {
            pg.all_reduce(&t, ReduceOp::Sum)
        } else {
            pg.broadcast(&t, 0)
        }
    })
    .unwrap_err();
    assert!(err.to_string().contains("rank 1 called broadcast"), "{err}");
}

#[test]
fn a_rank_that_exits_early_fails_its_peers_promptly() {
    let start = Instant::now();
    let err = launch(&LaunchOptions::new(3), |pg| {
        if pg.rank() == 1 {
            return Ok(()); // skips the collective
        }
        pg.barrier()
    })
    .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
    let msg = err.to_string();
    assert!(
        msg.contains("rank 1 exited without calling barrier"),
        "{msg}"
    );
}

#[test]
fn a_panicking_rank_is_named_and_peers_do_not_hang() {
    let err = launch(&LaunchOptions::new(2), |pg| {
        if pg.rank() == 0 {
            panic!("boom on purpose");
        }
        pg.barrier()
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("rank 0") && msg.contains("boom on purpose"),
        "{msg}"
    );
}

#[test]
fn a_collective_that_cannot_complete_times_out_naming_missing_ranks() {
    let mut opts = LaunchOptions::new(2);
    opts.timeout = Duration::from_millis(300);
    let err = launch(&opts, |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(2)); // stuck in compute, never arrives in time
            return Ok(());
        }
        pg.barrier()
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("timed out") && msg.contains("[1]"), "{msg}");
}

#[test]
fn local_shape_errors_name_the_rank() {
    let err = launch(&LaunchOptions::new(2), |pg| {
        let out = Tensor::zeros(&[3], DType::F32);
        let inp = Tensor::zeros(&[2], DType::F32);
        pg.all_gather_into_tensor(&out, &inp)
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("all_gather_into_tensor on rank"),
        "{err}"
    );
}

#[test]
fn subgroups_reduce_within_their_members_and_failures_reach_them() {
    let out = launch(&LaunchOptions::new(4), |pg| {
        // Every rank creates both node groups in the same order; it belongs to one.
        let a = pg.new_group(&[0, 1])?;
        let b = pg.new_group(&[2, 3])?;
        let mine = a.or(b).expect("every rank is in one group");
        let t = Tensor::from_vec(vec![pg.rank() as f32], &[1])?;
        mine.all_reduce(&t, ReduceOp::Sum)?;
        Ok((mine.rank(), mine.size(), t.to_vec_f32()?[0]))
    })
    .unwrap();
    assert_eq!(
        out,
        vec![(0, 2, 1.0), (1, 2, 1.0), (0, 2, 5.0), (1, 2, 5.0)]
    );

    let err = launch(&LaunchOptions::new(2), |pg| {
        pg.new_group(&[0, 0]).map(|_| ())
    })
    .unwrap_err();
    assert!(err.to_string().contains("distinct world ranks"), "{err}");

    // A rank that fails while its peer waits in a subgroup collective wakes the peer.
    let start = Instant::now();
    let err = launch(&LaunchOptions::new(3), |pg| {
        let sub = pg.new_group(&[1, 2])?;
        match pg.rank() {
            2 => Err(fsdp::Error::InvalidArgument("rank 2 gives up".into())),
            1 => sub.unwrap().barrier(),
            _ => Ok(()),
        }
    })
    .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(30));
    assert!(err.to_string().contains("rank 2 gives up"), "{err}");
}

#[test]
fn composite_collectives_match_sequential_references() {
    use fsdp::distributed::CollectivesExt;
    for world in 1..=5 {
        for dtype in [DType::F32, DType::I32] {
            let n = 3;
            let out = launch(&LaunchOptions::new(world), |pg| {
                let r = pg.rank();
                let mine = || {
                    Tensor::from_vec(rank_values(r, n), &[n])
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                // reduce to the last rank
                let red = mine();
                pg.reduce(&red, world - 1, ReduceOp::Sum)?;
                // all_gather (list) and gather to rank 0
                let list: Vec<Tensor> = (0..world).map(|_| Tensor::zeros(&[n], dtype)).collect();
                pg.all_gather(&list, &mine())?;
                let glist: Vec<Tensor> = (0..world).map(|_| Tensor::zeros(&[n], dtype)).collect();
                pg.gather(&mine(), (r == 0).then_some(&glist[..]), 0)?;
                // scatter from rank 0: rank j receives rank 0's values + j
                let inputs: Vec<Tensor> = (0..world)
                    .map(|j| {
                        Tensor::from_vec(
                            rank_values(0, n).iter().map(|v| v + j as f32).collect(),
                            &[n],
                        )
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                    })
                    .collect();
                let sc = Tensor::zeros(&[n], dtype);
                pg.scatter(&sc, (r == 0).then_some(&inputs[..]), 0)?;
                // all_to_all_single: chunk j of rank r's input is 100 r + j
                let a2a_in = Tensor::from_vec(
                    (0..world)
                        .flat_map(|j| vec![(100 * r + j) as f32; 2])
                        .collect(),
                    &[2 * world],
                )?
                .to_dtype(dtype)?;
                let a2a_out = Tensor::zeros(&[2 * world], dtype);
                pg.all_to_all_single(&a2a_out, &a2a_in)?;
                let v = |t: &Tensor| t.to_vec_f32().unwrap();
                Ok((
                    v(&red),
                    list.iter().map(v).collect::<Vec<_>>(),
                    glist.iter().map(v).collect::<Vec<_>>(),
                    v(&sc),
                    v(&a2a_out),
                ))
            })
            .unwrap();
            let cast = |x: Vec<f32>| {
                Tensor::from_vec(x.clone(), &[x.len()])
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .to_vec_f32()
                    .unwrap()
            };
            let each: Vec<Vec<f32>> = (0..world).map(|s| cast(rank_values(s, n))).collect();
            let sum: Vec<f32> = (0..n).map(|j| each.iter().map(|e| e[j]).sum()).collect();
            for (r, (red, list, glist, sc, a2a)) in out.iter().enumerate() {
                let what = format!("world {world} {dtype} rank {r}");
                if r == world - 1 {
                    assert_eq!(red, &cast(sum.clone()), "reduce {what}");
                } else {
                    assert_eq!(
                        red, &each[r],
                        "reduce leaves non-dst ranks unchanged, {what}"
                    );
                }
                assert_eq!(list, &each, "all_gather {what}");
                if r == 0 {
                    assert_eq!(glist, &each, "gather {what}");
                }
                assert_eq!(
                    sc,
                    &cast(rank_values(0, n).iter().map(|v| v + r as f32).collect()),
                    "scatter {what}"
                );
                let want: Vec<f32> = (0..world)
                    .flat_map(|j| vec![(100 * j + r) as f32; 2])
                    .collect();
                assert_eq!(a2a, &want, "all_to_all_single {what}");
            }
        }
    }
    // Wrong list lengths are errors that name the op.
    let err = launch(&LaunchOptions::new(2), |pg| {
        use fsdp::distributed::CollectivesExt;
        pg.all_gather(
            &[Tensor::zeros(&[1], DType::F32)],
            &Tensor::zeros(&[1], DType::F32),
        )
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("all_gather: the list has 1 tensors for a group of 2 ranks"),
        "{err}"
    );
}
