//! new_subgroups, DeviceMesh layouts with collectives on each dimension, and hybrid sharding
//! over a mesh.

use fsdp::distributed::{
    get_process_group_ranks, init_device_mesh, launch, new_subgroups, CollectivesExt, DeviceMesh,
    LaunchOptions, ProcessGroup, ReduceOp,
};
use fsdp::fsdp::{hybrid_groups, FsdpConfig, FullyShardedDataParallel, ShardingStrategy};
use fsdp::nn::{loss, Context, Module};
use fsdp::optim::{Optimizer, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};

fn sum_over(g: &dyn ProcessGroup, v: f32) -> fsdp::Result<f32> {
    let t = Tensor::from_vec(vec![v], &[1])?;
    g.all_reduce(&t, ReduceOp::Sum)?;
    Ok(t.to_vec_f32()?[0])
}

#[test]
fn new_subgroups_split_consecutive_ranks() {
    let out = launch(&LaunchOptions::new(6), |pg| {
        let r = pg.rank();
        let mut res = Vec::new();
        for size in [1, 2, 3, 6] {
            let (sub, all) = new_subgroups(&*pg, size)?;
            let sum = sum_over(&*sub, r as f32)?;
            res.push((
                sub.rank(),
                sub.size(),
                get_process_group_ranks(&*sub),
                all,
                sum,
            ));
        }
        // A subgroup splits further; its subgroups are named by world rank.
        let (half, _) = new_subgroups(&*pg, 3)?;
        let (single, all) = new_subgroups(&*half, 1)?;
        res.push((
            single.rank(),
            single.size(),
            single.ranks(),
            all,
            sum_over(&*single, r as f32)?,
        ));
        for bad in [0, 4, 7] {
            let err = new_subgroups(&*pg, bad)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            let want = match bad {
                0 => "group_size must be positive",
                4 => "the group size 6 is not divisible by group_size 4",
                _ => "group_size 7 exceeds the group size 6",
            };
            assert!(err.contains(want), "{err}");
        }
        Ok(res)
    })
    .unwrap();
    for (r, res) in out.iter().enumerate() {
        for (i, size) in [1usize, 2, 3, 6].into_iter().enumerate() {
            let chunks: Vec<Vec<usize>> = (0..6 / size)
                .map(|k| (k * size..(k + 1) * size).collect())
                .collect();
            let mine = &chunks[r / size];
            let (rank, got_size, ranks, all, sum) = &res[i];
            assert_eq!((*rank, *got_size), (r % size, size), "size {size} rank {r}");
            assert_eq!((ranks, all), (mine, &chunks), "size {size} rank {r}");
            assert_eq!(
                *sum,
                mine.iter().sum::<usize>() as f32,
                "size {size} rank {r}"
            );
        }
        let base = r / 3 * 3;
        let (rank, size, ranks, all, sum) = &res[4];
        assert_eq!((*rank, *size, ranks, *sum), (0, 1, &vec![r], r as f32));
        assert_eq!(all, &vec![vec![base], vec![base + 1], vec![base + 2]]);
    }
}

#[test]
fn a_2x2_mesh_runs_collectives_on_each_dimension() {
    let out = launch(&LaunchOptions::new(4), |pg| {
        let r = pg.rank();
        let mesh = init_device_mesh(&*pg, &[2, 2], &["replicate", "shard"])?;
        assert_eq!(mesh.mesh(), &[0, 1, 2, 3]);
        assert_eq!(
            (mesh.ndim(), mesh.shape(), mesh.numel(), mesh.get_rank()),
            (2, &[2, 2][..], 4, r)
        );
        assert_eq!(mesh.get_coordinate(), &[r / 2, r % 2]);
        assert_eq!(mesh.mesh_dim_names().unwrap(), &["replicate", "shard"]);
        let shard = mesh.get_group("shard")?;
        let rep = mesh.get_group("replicate")?;
        assert_eq!(shard.ranks(), mesh.get_group(1)?.ranks());
        assert_eq!(
            (mesh.get_local_rank("shard")?, mesh.get_local_rank(0)?),
            (shard.rank(), rep.rank())
        );
        assert_eq!((mesh.size("shard")?, mesh.size(0)?), (2, 2));
        // Collectives along each dimension.
        let row_sum = sum_over(&*shard, r as f32)?;
        let col_sum = sum_over(&*rep, r as f32)?;
        let gathered = Tensor::zeros(&[2], DType::I32);
        shard.all_gather_into_tensor(&gathered, &Tensor::from_vec(vec![10 * r as i32], &[1])?)?;
        let b = Tensor::from_vec(vec![r as f32], &[1])?;
        rep.broadcast(&b, 1)?;
        let mut red = Tensor::from_vec(vec![r as f32 + 1.0], &[1])?;
        rep.reduce(&red, 0, ReduceOp::Product)?;
        let red_v = red.to_vec_f32()?[0];
        red = Tensor::zeros(&[1], DType::F32);
        shard.scatter(
            &red,
            (shard.rank() == 0).then_some(&[Tensor::scalar(7.0), Tensor::scalar(8.0)][..]),
            0,
        )?;
        // Errors name the dimension.
        let e1 = mesh.get_group("tensor").err().unwrap().to_string();
        let e2 = mesh.get_group(2).err().unwrap().to_string();
        assert!(e1.contains("no dimension named 'tensor'"), "{e1}");
        assert!(
            e2.contains("dimension 2 is out of range for a 2-D mesh"),
            "{e2}"
        );
        Ok((
            row_sum,
            col_sum,
            gathered.to_vec_f32()?,
            b.to_vec_f32()?[0],
            red_v,
            red.to_vec_f32()?[0],
        ))
    })
    .unwrap();
    // Rows {0,1} {2,3} shard; columns {0,2} {1,3} replicate.
    for (r, (row, col, gathered, b, red, sc)) in out.into_iter().enumerate() {
        let row0 = r / 2 * 2;
        assert_eq!(row, (2 * row0 + 1) as f32, "rank {r}");
        assert_eq!(col, (2 * (r % 2) + 2) as f32, "rank {r}");
        assert_eq!(
            gathered,
            vec![10.0 * row0 as f32, 10.0 * (row0 + 1) as f32],
            "rank {r}"
        );
        assert_eq!(
            b,
            (r % 2 + 2) as f32,
            "broadcast from replicate rank 1, rank {r}"
        );
        let want_red = if r < 2 {
            ((r + 1) * (r + 3)) as f32
        } else {
            (r + 1) as f32
        };
        assert_eq!(red, want_red, "reduce to replicate rank 0, rank {r}");
        assert_eq!(sc, [7.0, 8.0][r % 2], "scatter along shard, rank {r}");
    }
}

#[test]
fn meshes_lay_ranks_out_row_major_in_any_shape() {
    for shape in [vec![4], vec![2, 3], vec![3, 2], vec![2, 2, 2], vec![1, 5]] {
        let n: usize = shape.iter().product();
        let out = launch(&LaunchOptions::new(n), |pg| {
            let mesh = DeviceMesh::new(&*pg, &shape, &[])?;
            let groups: Vec<Vec<usize>> = (0..shape.len())
                .map(|d| mesh.get_group(d).unwrap().ranks())
                .collect();
            let locals: Vec<usize> = (0..shape.len())
                .map(|d| mesh.get_local_rank(d).unwrap())
                .collect();
            let ranks_in: Vec<usize> = (0..shape.len())
                .map(|d| mesh.get_group(d).unwrap().rank())
                .collect();
            assert_eq!(locals, ranks_in);
            Ok((mesh.get_coordinate().to_vec(), groups))
        })
        .unwrap();
        let strides: Vec<usize> = (0..shape.len())
            .map(|d| shape[d + 1..].iter().product())
            .collect();
        for (r, (coord, groups)) in out.into_iter().enumerate() {
            let want_coord: Vec<usize> = (0..shape.len())
                .map(|d| r / strides[d] % shape[d])
                .collect();
            assert_eq!(coord, want_coord, "{shape:?} rank {r}");
            for (d, group) in groups.iter().enumerate() {
                // Ranks sharing every other coordinate with r.
                let want: Vec<usize> = (0..n)
                    .filter(|&q| {
                        (0..shape.len())
                            .all(|e| e == d || q / strides[e] % shape[e] == want_coord[e])
                    })
                    .collect();
                assert_eq!(group, &want, "{shape:?} dim {d} rank {r}");
            }
        }
    }
    let err = launch(&LaunchOptions::new(4), |pg| {
        DeviceMesh::new(&*pg, &[3, 2], &[]).map(|_| ())
    })
    .unwrap_err();
    assert!(
        err.to_string().contains(
            "mesh shape [3, 2] must have positive dimensions multiplying to the group size 4"
        ),
        "{err}"
    );
    let err = launch(&LaunchOptions::new(4), |pg| {
        DeviceMesh::new(&*pg, &[2, 2], &["a", "a"]).map(|_| ())
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("must be 2 distinct non-empty names"),
        "{err}"
    );
}

/// Two SGD steps of the uneven model under `cfg` on this rank; the full parameters after.
fn train_two_steps(pg: fsdp::distributed::Group, cfg: FsdpConfig) -> fsdp::Result<Vec<f32>> {
    let mut m = FullyShardedDataParallel::new(super::common::uneven_model(7), pg.clone(), cfg)?;
    let mut opt = SGD::new(SgdConfig {
        lr: 0.1,
        ..Default::default()
    });
    for step in 0..2 {
        let x = Tensor::from_vec(
            super::common::values((10 * step + pg.rank()) as u64, 14),
            &[2, 7],
        )?;
        let y = m.forward(&x, &Context::train())?;
        let (_, dy) = loss::sum_loss(&y)?;
        m.backward(&dy, &Context::train())?;
        opt.step(&m.optimizer_params())?;
        m.zero_grad();
    }
    Ok(m.full_parameters()?
        .into_iter()
        .flat_map(|(_, v)| v)
        .collect())
}

#[test]
fn hybrid_sharding_over_a_mesh_equals_hybrid_groups() {
    let out = launch(&LaunchOptions::new(4), |pg| {
        let mesh = init_device_mesh(&*pg, &[2, 2], &["replicate", "shard"])?;
        let (s, r) = hybrid_groups(&pg, 2)?;
        assert_eq!(
            (s.ranks(), r.ranks()),
            (mesh.get_group(1)?.ranks(), mesh.get_group(0)?.ranks())
        );
        let hybrid = |mesh: Option<DeviceMesh>, per_node: Option<usize>| FsdpConfig {
            sharding_strategy: ShardingStrategy::HybridShard,
            device_mesh: mesh,
            ranks_per_node: per_node,
            ..Default::default()
        };
        let via_mesh = train_two_steps(pg.clone(), hybrid(Some(mesh.clone()), None))?;
        let via_nodes = train_two_steps(pg.clone(), hybrid(None, Some(2)))?;
        // Misuse is an error, not a silent fallback.
        let e_strategy = train_two_steps(
            pg.clone(),
            FsdpConfig {
                device_mesh: Some(mesh.clone()),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        let one_d = init_device_mesh(&*pg, &[4], &[])?;
        let e_1d = train_two_steps(pg.clone(), hybrid(Some(one_d), None))
            .unwrap_err()
            .to_string();
        let e_both = train_two_steps(pg.clone(), hybrid(Some(mesh), Some(2)))
            .unwrap_err()
            .to_string();
        // Hybrid-only options under another strategy are errors, not silently ignored.
        let e_rpn = train_two_steps(
            pg.clone(),
            FsdpConfig {
                ranks_per_node: Some(2),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e_rpn
                .contains("ranks_per_node is for HybridShard and HybridShardZero2; with FullShard"),
            "{e_rpn}"
        );
        // Nothing says which ranks share a node: an error (FSDP1's ValueError), not a
        // silent FullShard over the whole world.
        let e_none = train_two_steps(pg.clone(), hybrid(None, None))
            .unwrap_err()
            .to_string();
        Ok((via_mesh, via_nodes, e_strategy, e_1d, e_both, e_none))
    })
    .unwrap();
    for (r, (via_mesh, via_nodes, e_strategy, e_1d, e_both, e_none)) in out.iter().enumerate() {
        let bits = |v: &Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(via_mesh), bits(via_nodes), "rank {r}");
        assert_eq!(bits(via_mesh), bits(&out[0].0), "replicas agree, rank {r}");
        assert!(
            e_strategy
                .contains("device_mesh is for HybridShard and HybridShardZero2; with FullShard"),
            "{e_strategy}"
        );
        assert!(
            e_1d.contains("2-D device_mesh (replicate, shard) alone, got a 1-D mesh"),
            "{e_1d}"
        );
        assert!(e_both.contains("with ranks_per_node"), "{e_both}");
        for way in ["ranks_per_node", "hybrid_groups", "device_mesh"] {
            assert!(e_none.contains(way), "{e_none}");
        }
        assert!(e_none.starts_with("fsdp: HybridShard needs"), "{e_none}");
    }
}
