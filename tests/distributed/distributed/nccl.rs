//! The `nccl` backend. Without libnccl (CI) it must refuse with one clear error; with NCCL
//! and a GPU (a lent machine), a world of one rank must move every collective exactly.

use fsdp::backend::Device;
use fsdp::distributed::nccl::{self, NcclGroup};
use fsdp::distributed::staged;
use fsdp::distributed::{ProcessGroup, ReduceOp, Store, TcpStore};
use fsdp::tensor::{DType, Tensor};
use std::sync::Arc;
use std::time::Duration;

fn world_of_one() -> Option<NcclGroup> {
    let store: Arc<dyn Store> =
        Arc::new(TcpStore::new("127.0.0.1", 0, 0, true, Duration::from_secs(5)).unwrap());
    let r = NcclGroup::new(0, 1, 0, store, Duration::from_secs(30));
    if !nccl::is_available() {
        let e = r.expect_err("NCCL group without libnccl");
        assert!(
            e.to_string().contains("no NCCL library found (libnccl.so)"),
            "{e}"
        );
        eprintln!("skipping NCCL collectives: {e}");
        return None;
    }
    match fsdp::backend::cuda::detect() {
        Ok(_) => Some(r.expect("NCCL world of one on cuda:0")),
        Err(e) => {
            eprintln!("skipping NCCL collectives: {e}");
            None
        }
    }
}

#[test]
fn nccl_world_of_one_is_exact_or_refused_clearly() {
    let Some(g) = world_of_one() else { return };
    assert_eq!((g.rank(), g.size(), g.backend()), (0, 1, "nccl"));
    let dev = Device::Cuda(0);
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::I32, DType::F64] {
        for n in [0usize, 1, 5, 33] {
            let vals: Vec<f32> = (0..n).map(|i| i as f32 - 3.0).collect();
            let host = Tensor::from_vec(vals.clone(), &[n])
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let x = host.to_device(dev).unwrap();
            let out = Tensor::zeros_on(&[n], dtype, dev).unwrap();
            g.all_gather_into_tensor(&out, &x).unwrap();
            assert_eq!(out.to_vec_f32().unwrap(), vals, "all_gather {dtype} n={n}");
            g.reduce_scatter_tensor(&out, &x, ReduceOp::Sum).unwrap();
            assert_eq!(
                out.to_vec_f32().unwrap(),
                vals,
                "reduce_scatter {dtype} n={n}"
            );
            g.all_reduce(&x, ReduceOp::Sum).unwrap();
            assert_eq!(x.to_vec_f32().unwrap(), vals, "all_reduce {dtype} n={n}");
            g.broadcast(&x, 0).unwrap();
            assert_eq!(x.to_vec_f32().unwrap(), vals, "broadcast {dtype} n={n}");
        }
    }
    g.barrier().unwrap();
    let host = Tensor::zeros(&[4], DType::F32);
    let e = g.all_reduce(&host, ReduceOp::Sum).unwrap_err();
    assert!(e.to_string().contains("expected a tensor on cuda:0"), "{e}");

    // Overlapping input and output that are not NCCL's in-place layout: copied first.
    let buf = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[4])
        .unwrap()
        .to_device(dev)
        .unwrap();
    let (out, input) = (buf.view(0, &[3]).unwrap(), buf.view(1, &[3]).unwrap());
    g.all_gather_into_tensor(&out, &input).unwrap();
    assert_eq!(buf.to_vec_f32().unwrap(), vec![2.0, 3.0, 4.0, 4.0]);
    g.reduce_scatter_tensor(&input, &out, ReduceOp::Sum)
        .unwrap();
    assert_eq!(buf.to_vec_f32().unwrap(), vec![2.0, 2.0, 3.0, 4.0]);

    // The bookkeeping collectives of training and checkpoints (host tensors) go through
    // `staged`, which moves them to the group's GPU and back.
    assert_eq!(g.collective_device(), Some(dev));
    let host = Tensor::from_vec(vec![3i32, -7, 11], &[3]).unwrap();
    staged::all_reduce(&g, &host, ReduceOp::Max).unwrap();
    assert_eq!(*host.data::<i32>().unwrap(), [3, -7, 11]);
    staged::broadcast(&g, &host, 0).unwrap();
    assert_eq!(*host.data::<i32>().unwrap(), [3, -7, 11]);
    let all = Tensor::zeros(&[3], DType::I32);
    staged::all_gather_into_tensor(&g, &all, &host).unwrap();
    assert_eq!(*all.data::<i32>().unwrap(), [3, -7, 11]);
}

#[test]
fn init_process_group_nccl_joins_a_world_of_one_or_says_what_is_missing() {
    use fsdp::distributed::{destroy_process_group, init_process_group, InitOptions};
    let port = crate::common::free_port();
    let opts = InitOptions::new("nccl").with_env([
        ("WORLD_SIZE", "1".to_string()),
        ("RANK", "0".to_string()),
        ("LOCAL_RANK", "0".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ]);
    let ready = nccl::is_available() && fsdp::backend::cuda::detect().is_ok();
    match init_process_group(opts) {
        Ok(g) => {
            assert!(ready, "joined an NCCL world without NCCL or a GPU");
            assert_eq!((g.backend(), g.size()), ("nccl", 1));
            let t = Tensor::from_vec(vec![1.5f32, -2.0], &[2])
                .unwrap()
                .to_device(Device::Cuda(0))
                .unwrap();
            g.all_reduce(&t, ReduceOp::Sum).unwrap();
            assert_eq!(t.to_vec_f32().unwrap(), vec![1.5, -2.0]);
            destroy_process_group().unwrap();
        }
        Err(e) => {
            assert!(!ready, "NCCL and a GPU are present, but: {e}");
            let s = e.to_string();
            assert!(
                s.contains("libnccl.so") || s.contains("CUDA") || s.contains("cuda"),
                "{s}"
            );
        }
    }
}
