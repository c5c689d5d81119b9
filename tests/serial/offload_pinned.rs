//! CPU offload on CUDA with the shards in pinned host memory (FSDP1's
//! `CpuOffload(offload_params=True)`): the parameter shards go to the device and the
//! gradient shards come back asynchronously, and the host waits once per backward.
//!
//! - the losses of `fsdp train --device cuda --cpu-offload` match those of the same run
//!   without offload (f32 and bf16 mixed precision, 1 and 2 thread ranks; bit for bit on
//!   cuda-emu);
//! - from step 2 on, no step pins host memory or allocates device memory, and each rank's
//!   host waits for the device at most once on a step that reads nothing back;
//! - the ordering: without the end of backward's synchronization (the `test-hooks` hook
//!   `FSDP_TEST_OFFLOAD_NO_SYNC=1`) the CPU optimizer reads gradient shards whose copies
//!   have not run, and on cuda-emu (which runs a stream's work only when something forces
//!   it) the losses change, so the synchronization is what makes them right.
//!
//! Also the pinned tensors themselves: CPU ops on them, asynchronous copies.
//!
//! One test, in the `serial` binary, which runs its tests one at a time: the counters and
//! the hook's variable are process-wide.
//! Without a GPU it prints "skipping ... on CUDA" and passes.

use crate::common;

use fsdp::train::{train, Precision, Silent, TrainConfig, TrainDevice, TrainReport};

fn cfg(data: &std::path::Path, world: usize, offload: bool, mp: Precision) -> TrainConfig {
    TrainConfig {
        steps: 6,
        device: TrainDevice::Cuda,
        cpu_offload: offload,
        mixed_precision: mp,
        ..common::small_job(data.to_path_buf(), world)
    }
}

fn run(cfg: &TrainConfig) -> TrainReport {
    train(cfg, &Silent).unwrap_or_else(|e| panic!("{cfg:?}: {e}"))
}

/// Asserts what a steady offload step asks of the host: from step 2 on no pinned, device
/// or FSDP buffer allocation, and at most one host synchronization per rank on the steps
/// between the first and the last (which read the losses back).
fn check_counters(name: &str, report: &TrainReport, world: usize) {
    let recs = &report.records;
    let last = recs.len();
    // Without the caching allocator every device tensor is a driver allocation.
    let caching = std::env::var("FSDP_CUDA_NO_CACHING").map_or(true, |v| v != "1");
    for r in &recs[1..] {
        let c = &r.counters;
        let device_allocs = if caching { c.device_allocs } else { 0 };
        assert_eq!(
            (c.pinned_allocs, device_allocs, c.fsdp_buffer_allocs),
            (0, 0, 0),
            "{name}: step {} allocates (pinned, device, FSDP buffers): {c:?}",
            r.step
        );
        if r.step != last {
            assert!(
                c.host_syncs as usize <= world,
                "{name}: step {} waits for the device {} times (at most once per rank): {c:?}",
                r.step,
                c.host_syncs
            );
        }
    }
    // The first step pinned the shards' buffers (a step that pins nothing would mean the
    // shards are not pinned).
    assert!(
        recs[0].counters.pinned_allocs > 0,
        "{name}: step 1 pinned no host memory: {:?}",
        recs[0].counters
    );
}

/// A pinned tensor is a host tensor to the CPU ops; its copies to and from the device are
/// queued without a host wait, and (on cuda-emu, which runs them only when forced) land
/// when the stream is synchronized.
fn pinned_copies(emulated: bool) {
    use fsdp::backend::counters::{host_syncs_on_this_thread, Counters};
    use fsdp::backend::Device;
    use fsdp::tensor::{DType, Tensor};
    let c0 = Counters::now();
    let host = Tensor::pinned_zeros(&[4], DType::F32, 0).unwrap();
    assert_eq!(Counters::now().since(&c0).pinned_allocs, 1);
    assert!(host.is_pinned() && host.device() == Device::Cpu);
    fsdp::ops::fill_(&host, 1.5).unwrap();
    let one = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    fsdp::ops::add_(&host, &one).unwrap();
    assert_eq!(host.to_vec_f32().unwrap(), [2.5, 3.5, 4.5, 5.5]);
    // To the device and back, each copy queued on the current stream.
    let dev = Tensor::zeros_on(&[4], DType::F32, Device::Cuda(0)).unwrap();
    let back = Tensor::pinned_zeros(&[4], DType::F32, 0).unwrap();
    let syncs = host_syncs_on_this_thread();
    dev.copy_from_non_blocking(&host).unwrap();
    fsdp::ops::scale_(&dev, 2.0).unwrap();
    back.copy_from_non_blocking(&dev).unwrap();
    assert_eq!(
        host_syncs_on_this_thread(),
        syncs,
        "a pinned copy waited for the device"
    );
    if emulated {
        // Nothing forced the stream: the copy back has not run.
        assert_eq!(back.to_vec_f32().unwrap(), [0.0; 4]);
    }
    // Reading a device tensor synchronizes the stream, the copy back included.
    assert_eq!(dev.to_vec_f32().unwrap(), [5.0, 7.0, 9.0, 11.0]);
    assert_eq!(back.to_vec_f32().unwrap(), [5.0, 7.0, 9.0, 11.0]);
    // A dtype change goes through the ordinary (host-side) path.
    let lp = Tensor::pinned_zeros(&[4], DType::BF16, 0).unwrap();
    lp.copy_from_non_blocking(&dev).unwrap();
    assert_eq!(lp.to_vec_f32().unwrap(), [5.0, 7.0, 9.0, 11.0]);
}

#[test]
fn offload_in_pinned_memory_matches_training_on_the_device_cuda() {
    let _serial = crate::serial();
    let devices = match fsdp::backend::cuda::detect() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping offload_in_pinned_memory_matches_training_on_the_device_cuda on CUDA: {e}");
            return;
        }
    };
    let emulated = devices.iter().all(|d| d.name.starts_with("cuda-emu"));
    pinned_copies(emulated);
    let data = common::corpus_file("offload-pinned");
    std::env::remove_var("FSDP_TEST_OFFLOAD_NO_SYNC");
    for world in [1, 2] {
        for mp in [Precision::None, Precision::Bf16] {
            let name = format!("world {world}, {mp:?}");
            let want = run(&cfg(&data, world, false, mp)).losses();
            let report = run(&cfg(&data, world, true, mp));
            // The optimizer steps on the host instead of the device: the same arithmetic
            // on the same values, in f32 (bit for bit on cuda-emu, whose kernels are the
            // host's arithmetic; a GPU may contract a multiply-add differently).
            let rtol = if emulated { 0.0 } else { 1e-5 };
            common::assert_close(&name, &report.losses(), &want, 0.0, rtol);
            check_counters(&name, &report, world);
        }
    }
    // The ordering: skip the end of backward's synchronization.
    let want = run(&cfg(&data, 1, true, Precision::None)).losses();
    std::env::set_var("FSDP_TEST_OFFLOAD_NO_SYNC", "1");
    let unsynced = run(&cfg(&data, 1, true, Precision::None)).losses();
    std::env::remove_var("FSDP_TEST_OFFLOAD_NO_SYNC");
    // Without the caching allocator every free of a device tensor is a `cuMemFree`, which
    // runs the device's queued work: the copies land in time anyway.
    let caching = std::env::var("FSDP_CUDA_NO_CACHING").map_or(true, |v| v != "1");
    if emulated && caching {
        // Every step from 2 on follows an optimizer step on gradients the device had not
        // copied yet. (Even step 1's loss may move: its forward's copies of the shards to
        // the device, not waited for either, can run after the optimizer wrote them.)
        assert!(
            unsynced[1..].iter().zip(&want[1..]).all(|(u, w)| u != w),
            "without the end-of-backward synchronization the losses should change: {unsynced:?} vs {want:?}"
        );
    } else {
        // A real GPU may finish the copies before the host reads them: nothing to assert.
        eprintln!("offload ordering: {unsynced:?} without the synchronization, {want:?} with");
    }
}
