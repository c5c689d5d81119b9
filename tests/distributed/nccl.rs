//! The `nccl` backend. Without libnccl (CI) it must refuse with one clear error; with NCCL
//! and a GPU (a lent machine), a world of one rank must move every collective exactly.

use fsdp::backend::Device;
use fsdp::distributed::nccl::{self, IdStore, NcclGroup};
use fsdp::distributed::{ProcessGroup, ReduceOp};
use fsdp::tensor::{DType, Tensor};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An in-process store with the TCP store's waiting `get`.
#[derive(Default)]
struct MemStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
}

impl IdStore for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> fsdp::Result<()> {
        self.map.lock().insert(key.to_string(), value.to_vec());
        self.cv.notify_all();
        Ok(())
    }
    fn get(&self, key: &str) -> fsdp::Result<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut m = self.map.lock();
        loop {
            if let Some(v) = m.get(key) {
                return Ok(v.clone());
            }
            if self.cv.wait_until(&mut m, deadline).timed_out() {
                return Err(fsdp::Error::InvalidArgument(format!("no key {key}")));
            }
        }
    }
    fn try_get(&self, key: &str) -> fsdp::Result<Option<Vec<u8>>> {
        Ok(self.map.lock().get(key).cloned())
    }
}

fn world_of_one() -> Option<NcclGroup> {
    let store: Arc<dyn IdStore> = Arc::new(MemStore::default());
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
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::I32] {
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
}
