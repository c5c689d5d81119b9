//! Tests of device-dispatching code written once for every device: [`device_test!`] makes
//! `<name>_cpu` (run on `Device::Cpu`) and `<name>_cuda` (run on `Device::Cuda(0)`, or a
//! skip notice when the build has no `cuda` feature or the machine no driver or device)
//! from one body `fn(Device) -> fsdp::Result<()>`. A body computes on the device it is
//! given and compares with the CPU ([`check`]): bitwise when that device is the CPU, to f32
//! rounding on CUDA. Bodies also check the CPU against independent references, so the
//! `_cpu` variant asserts something of its own.
#![allow(dead_code)]

use fsdp::backend::Device;
use fsdp::tensor::Tensor;

/// Makes `$name_cpu` and `$name_cuda` from `$body: fn(Device) -> fsdp::Result<()>`.
#[macro_export]
macro_rules! device_test {
    ($name:ident, $body:expr) => {
        pastey::paste! {
            #[test]
            fn [<$name _cpu>]() {
                let f: fn(fsdp::backend::Device) -> fsdp::Result<()> = $body;
                f(fsdp::backend::Device::Cpu).unwrap();
            }
            #[test]
            fn [<$name _cuda>]() {
                let f: fn(fsdp::backend::Device) -> fsdp::Result<()> = $body;
                match $crate::device::cuda_device() {
                    Ok(d) => f(d).unwrap(),
                    Err(why) => eprintln!("skipping {} on CUDA: {why}", stringify!($name)),
                }
            }
        }
    };
}

/// `Device::Cuda(0)`, or why there is none (no feature, driver or device).
pub fn cuda_device() -> Result<Device, String> {
    match fsdp::backend::cuda::detect() {
        Ok(devs) if !devs.is_empty() => Ok(Device::Cuda(0)),
        Ok(_) => Err("no CUDA device".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Relative f32 tolerance of one CUDA layer against the CPU (GEMMs and row reductions sum
/// in another order).
pub const REL: f32 = 1e-5;

/// `got` (computed on `dev`, and living there) against `want` (the CPU's): same shape;
/// bitwise equal when `dev` is the CPU, else within `rel` of the largest `|want|` plus
/// `rel` of each element.
pub fn check(what: &str, dev: Device, got: &Tensor, want: &Tensor, rel: f32) {
    assert_eq!(got.device(), dev, "{what}: computed on the wrong device");
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    let (g, w) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
    if dev == Device::Cpu {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&g), bits(&w), "{what}: not bitwise equal on the CPU");
    } else {
        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        crate::common::assert_close(&format!("{what} on {dev}"), &g, &w, rel * scale, rel);
    }
}

/// `values` as an f32 tensor of `shape` on `dev`.
pub fn tensor_on(values: Vec<f32>, shape: &[usize], dev: Device) -> Tensor {
    Tensor::from_vec(values, shape)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

/// i32 `ids` of `shape` on `dev`.
pub fn ids_on(ids: Vec<i32>, shape: &[usize], dev: Device) -> Tensor {
    Tensor::from_vec(ids, shape)
        .unwrap()
        .to_device(dev)
        .unwrap()
}
