//! The threads backend's collectives against sequential references, its failure modes,
//! init_process_group (`distributed/init.rs`), subgroups and meshes (`distributed/mesh.rs`),
//! the nccl backend (`distributed/nccl.rs`, with the `cuda` feature).

use crate::common;
mod init;
mod mesh;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod nccl_world;

use fsdp::distributed::{launch, LaunchOptions, ReduceOp};
use fsdp::tensor::{DType, Tensor};
use std::time::{Duration, Instant};

/// `n` exact values for rank data `seed`: multiples of 1/8 in [-1, 1) for float dtypes
/// (exact in bf16/f16, and so are sums of 8 of them), integers in [-8, 8) for i32.
fn exact_values(seed: usize, n: usize, dtype: DType) -> Vec<f64> {
    common::values(seed as u64 + 1, n)
        .iter()
        .map(|v| {
            let k = (v * 8.0).floor() as f64;
            if dtype == DType::I32 {
                k
            } else {
                k / 8.0
            }
        })
        .collect()
}

fn tensor_of(v: &[f64], dtype: DType) -> Tensor {
    let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    Tensor::from_vec(f, &[v.len()])
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// What a tensor of `dtype` holds after storing `v` (one rounding, as the backend's).
fn stored(v: &[f64], dtype: DType) -> Vec<f32> {
    tensor_of(v, dtype).to_vec_f32().unwrap()
}

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

fn reduce_ref(op: ReduceOp, xs: &[Vec<f64>], j: usize) -> f64 {
    let it = xs.iter().map(|x| x[j]);
    match op {
        ReduceOp::Sum => it.sum(),
        ReduceOp::Avg => it.sum::<f64>() / xs.len() as f64,
        ReduceOp::Max => it.fold(f64::MIN, f64::max),
        ReduceOp::Min => it.fold(f64::MAX, f64::min),
        ReduceOp::Product => it.product(),
    }
}

/// Seeds of each rank's inputs: `x` (n elements), `big` (world * n), scatter list entries.
fn x_seed(r: usize) -> usize {
    r
}
fn big_seed(r: usize) -> usize {
    100 + r
}
fn scatter_seed(j: usize) -> usize {
    200 + j
}

/// Every collective on one world, one size and one dtype; returns `(what, values)` per rank.
fn run_every_collective(world: usize, n: usize, dtype: DType) -> Vec<Vec<(String, Vec<f32>)>> {
    use fsdp::distributed::CollectivesExt;
    launch(&LaunchOptions::new(world), |pg| {
        let r = pg.rank();
        let mut out: Vec<(String, Vec<f32>)> = Vec::new();
        let mut put = |what: &str, t: &Tensor| -> fsdp::Result<()> {
            out.push((what.to_string(), t.to_vec_f32()?));
            Ok(())
        };
        let x = || tensor_of(&exact_values(x_seed(r), n, dtype), dtype);
        let big = || tensor_of(&exact_values(big_seed(r), n * world, dtype), dtype);

        let g = Tensor::zeros(&[n * world], dtype);
        pg.all_gather_into_tensor(&g, &x())?;
        put("all_gather_into_tensor", &g)?;
        let list: Vec<Tensor> = (0..world).map(|_| Tensor::zeros(&[n], dtype)).collect();
        pg.all_gather(&list, &x())?;
        for (j, t) in list.iter().enumerate() {
            put(&format!("all_gather[{j}]"), t)?;
        }
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let shard = Tensor::zeros(&[n], dtype);
            pg.reduce_scatter_tensor(&shard, &big(), op)?;
            put(&format!("reduce_scatter_tensor {op:?}"), &shard)?;
        }
        for op in OPS {
            let t = x();
            pg.all_reduce(&t, op)?;
            put(&format!("all_reduce {op:?}"), &t)?;
        }
        let src = world - 1;
        let t = x();
        pg.broadcast(&t, src)?;
        put("broadcast", &t)?;
        let dst = world / 2;
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let t = x();
            pg.reduce(&t, dst, op)?;
            put(&format!("reduce {op:?}"), &t)?;
        }
        let inputs: Vec<Tensor> = (0..world)
            .map(|j| tensor_of(&exact_values(scatter_seed(j), n, dtype), dtype))
            .collect();
        let sc = Tensor::zeros(&[n], dtype);
        pg.scatter(&sc, (r == src).then_some(&inputs[..]), src)?;
        put("scatter", &sc)?;
        let glist: Vec<Tensor> = (0..world).map(|_| Tensor::zeros(&[n], dtype)).collect();
        pg.gather(&x(), (r == dst).then_some(&glist[..]), dst)?;
        if r == dst {
            for (j, t) in glist.iter().enumerate() {
                put(&format!("gather[{j}]"), t)?;
            }
        }
        let a2a = Tensor::zeros(&[n * world], dtype);
        pg.all_to_all_single(&a2a, &big())?;
        put("all_to_all_single", &a2a)?;
        pg.barrier()?;
        Ok(out)
    })
    .unwrap()
}

/// The same results computed sequentially from every rank's inputs.
fn reference(world: usize, n: usize, dtype: DType) -> Vec<Vec<(String, Vec<f32>)>> {
    let xs: Vec<Vec<f64>> = (0..world)
        .map(|r| exact_values(x_seed(r), n, dtype))
        .collect();
    let bigs: Vec<Vec<f64>> = (0..world)
        .map(|r| exact_values(big_seed(r), n * world, dtype))
        .collect();
    let (src, dst) = (world - 1, world / 2);
    (0..world)
        .map(|r| {
            let mut out: Vec<(String, Vec<f32>)> = Vec::new();
            let mut put = |what: String, v: Vec<f64>| out.push((what, stored(&v, dtype)));
            put("all_gather_into_tensor".into(), xs.concat());
            for (j, x) in xs.iter().enumerate() {
                put(format!("all_gather[{j}]"), x.clone());
            }
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let chunks: Vec<Vec<f64>> = bigs
                    .iter()
                    .map(|b| b[r * n..(r + 1) * n].to_vec())
                    .collect();
                let v = (0..n).map(|j| reduce_ref(op, &chunks, j)).collect();
                put(format!("reduce_scatter_tensor {op:?}"), v);
            }
            for op in OPS {
                put(
                    format!("all_reduce {op:?}"),
                    (0..n).map(|j| reduce_ref(op, &xs, j)).collect(),
                );
            }
            put("broadcast".into(), xs[src].clone());
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let v = if r == dst {
                    (0..n).map(|j| reduce_ref(op, &xs, j)).collect()
                } else {
                    xs[r].clone()
                };
                put(format!("reduce {op:?}"), v);
            }
            put("scatter".into(), exact_values(scatter_seed(r), n, dtype));
            if r == dst {
                for (j, x) in xs.iter().enumerate() {
                    put(format!("gather[{j}]"), x.clone());
                }
            }
            // Chunk j of the output is chunk r of rank j's input.
            let a2a = (0..world)
                .flat_map(|j| bigs[j][r * n..(r + 1) * n].to_vec())
                .collect();
            put("all_to_all_single".into(), a2a);
            out
        })
        .collect()
}

#[test]
fn every_collective_matches_a_sequential_reference() {
    // World sizes 1-8; per-rank sizes 0 (empty), 1, 5 and 33 (no world size > 1 divides
    // them); every dtype. Inputs are exact in every dtype, so every op but Avg is compared
    // exactly; Avg divides, and may round differently by one unit in the last place.
    for world in 1..=8 {
        for n in [0usize, 1, 5, 33] {
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::I32] {
                let got = run_every_collective(world, n, dtype);
                let want = reference(world, n, dtype);
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    let names = |v: &Vec<(String, Vec<f32>)>| {
                        v.iter().map(|(s, _)| s.clone()).collect::<Vec<_>>()
                    };
                    assert_eq!(names(g), names(w), "world {world} rank {r}");
                    for ((what, gv), (_, wv)) in g.iter().zip(w) {
                        let ctx = format!("{what}: world {world} n {n} {dtype} rank {r}");
                        if what.contains("Avg") {
                            let (atol, rtol) = match dtype {
                                DType::I32 => (1.0, 0.0),
                                d => (1e-6, d.epsilon()),
                            };
                            common::assert_close(&ctx, gv, wv, atol, rtol);
                        } else {
                            assert_eq!(gv, wv, "{ctx}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn collectives_check_their_arguments() {
    use fsdp::distributed::CollectivesExt;
    let err = launch(&LaunchOptions::new(2), |pg| {
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
    let err = launch(&LaunchOptions::new(2), |pg| {
        let t = Tensor::zeros(&[2], DType::F32);
        pg.broadcast(&t, 2)
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("src rank 2 is not in a group of 2"),
        "{err}"
    );
    let err = launch(&LaunchOptions::new(3), |pg| {
        let t = Tensor::zeros(&[4], DType::F32);
        pg.all_to_all_single(&t, &t.deep_clone()?)
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("do not split into 3 equal chunks"),
        "{err}"
    );
    let err = launch(&LaunchOptions::new(2), |pg| {
        let t = Tensor::zeros(&[4], DType::F32);
        pg.reduce_scatter_tensor(&Tensor::zeros(&[2], DType::F32), &t, ReduceOp::Max)
    })
    .unwrap_err();
    assert!(err.to_string().contains("supports Sum and Avg"), "{err}");
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
