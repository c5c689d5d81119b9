//! The host of `tests/capi_cuda.rs`: its tensors in host memory (a CPU model) or in device
//! memory it allocated with `cuMemAlloc`, copied on its own stream (or the legacy stream),
//! and an MLP it computes itself (plain loops on the CPU, between copies):
//!
//!   x (n, 7) -> unit "0": W0 (5x7), b0 -> ReLU -> unit "2": W2 (3x5), b2 -> y (n, 3),
//!   loss: mean over the rank's rows of (y - t)^2, gradients averaged over the ranks.
//!
//! Unit "2"'s gradients are added into fsdp's gradient views (read, add, write back on the
//! host's stream); unit "0"'s are the host's own buffers handed to post_backward (bfloat16
//! under mixed precision).

use super::common::{assert_close, values};
use cudarc::driver::{result as cu, sys};
use fsdp_capi::*;
use std::ffi::{c_char, c_void, CStr, CString};

const IN: usize = 7;
const HID: usize = 5;
const OUT: usize = 3;
const ROWS: usize = 8;
const STEPS: usize = 3;

fn last_error() -> String {
    // SAFETY: a NUL-terminated string of this thread.
    unsafe { CStr::from_ptr(fsdp_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn status_name(s: fsdp_status) -> String {
    // SAFETY: a static string.
    unsafe { CStr::from_ptr(fsdp_status_name(s)) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn must(s: fsdp_status) {
    assert_eq!(s, FSDP_OK, "{}: {}", status_name(s), last_error());
}

/// Asserts that a call failed with `status` and a message containing `msg`.
#[track_caller]
fn fails(s: fsdp_status, status: &str, msg: &str) {
    let (name, text) = (status_name(s), last_error());
    assert_eq!(name, status, "{text}");
    assert!(text.contains(msg), "{text:?} does not contain {msg:?}");
}

/// Where the host keeps its tensors, and its stream.
pub struct Host {
    /// Device memory of cuda:0 (else host memory).
    device: bool,
    stream: sys::CUstream,
    /// Device allocations, freed at the end.
    allocs: Vec<u64>,
    /// Host buffers (4-byte words), kept alive until the end.
    bufs: Vec<Box<[u32]>>,
    /// Shapes the `DLTensor`s point at.
    shapes: Vec<Box<[i64]>>,
}

impl Host {
    /// A host whose tensors are on cuda:0 (`device`), on a stream of its own or the legacy
    /// stream (`legacy`), or in host memory.
    pub fn new(device: bool, legacy: bool) -> Host {
        let mut stream = std::ptr::null_mut();
        if device {
            fsdp::backend::cuda::CudaDevice::get(0)
                .and_then(|d| d.bind_to_thread())
                .unwrap();
            if !legacy {
                stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).unwrap();
            }
        }
        Host {
            device,
            stream,
            allocs: Vec::new(),
            bufs: Vec::new(),
            shapes: Vec::new(),
        }
    }

    /// The `stream` argument of every call: NULL for host memory.
    pub fn stream(&self) -> *mut c_void {
        self.stream as *mut c_void
    }

    /// A new tensor of `shape` holding `vals` (float32, or bfloat16 rounded to nearest);
    /// on the device the upload is queued on the host's stream.
    pub fn tensor(&mut self, vals: &[f32], shape: &[usize], bf16: bool) -> DLTensor {
        let bytes: Vec<u8> = match bf16 {
            true => vals
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            false => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let data = if self.device {
            // SAFETY: a context is current (new); the upload stages `bytes` before
            // returning (pageable memory).
            let p = unsafe { cu::malloc_sync(bytes.len().max(4)) }.unwrap();
            unsafe { cu::memcpy_htod_async(p, &bytes, self.stream) }.unwrap();
            self.allocs.push(p);
            p as *mut c_void
        } else {
            let mut words = vec![0u32; bytes.len().div_ceil(4).max(1)].into_boxed_slice();
            bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..bytes.len()].copy_from_slice(&bytes);
            let p = words.as_mut_ptr() as *mut c_void;
            self.bufs.push(words);
            p
        };
        let shape: Box<[i64]> = shape.iter().map(|&d| d as i64).collect();
        let t = DLTensor {
            data,
            device: DLDevice {
                device_type: if self.device { 2 } else { 1 },
                device_id: 0,
            },
            ndim: shape.len() as i32,
            dtype: DLDataType {
                code: if bf16 { 4 } else { 2 },
                bits: if bf16 { 16 } else { 32 },
                lanes: 1,
            },
            shape: shape.as_ptr() as *mut i64,
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        self.shapes.push(shape);
        t
    }

    /// The values of `t` (float32 or bfloat16, host or device memory; a device copy on the
    /// host's stream, which is then synchronized).
    pub fn read(&self, t: &DLTensor) -> Vec<f32> {
        // SAFETY: shape holds ndim values.
        let n: usize = (0..t.ndim as usize)
            .map(|i| unsafe { *t.shape.add(i) } as usize)
            .product();
        let width = t.dtype.bits as usize / 8;
        assert!((t.dtype.code == 2 && width == 4) || (t.dtype.code == 4 && width == 2));
        assert_eq!(t.device.device_type, if self.device { 2 } else { 1 });
        let mut bytes = vec![0u8; n * width];
        let src = (t.data as usize + t.byte_offset as usize) as u64;
        if self.device {
            // SAFETY: device memory of n elements; the copy ends before the sync returns.
            unsafe {
                cu::memcpy_dtoh_async(&mut bytes, src, self.stream).unwrap();
                cu::stream::synchronize(self.stream).unwrap();
            }
        } else if n > 0 {
            // SAFETY: host memory of n elements (fsdp's view, or the host's own buffer).
            unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, bytes.as_mut_ptr(), bytes.len())
            };
        }
        bytes
            .chunks(width)
            .map(|c| match width {
                4 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                _ => half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
            })
            .collect()
    }

    /// `t += add` (float32): read, add, write back (a device upload queued on the host's
    /// stream).
    pub fn add_into(&self, t: &DLTensor, add: &[f32], expect_zero: bool) {
        let cur = self.read(t);
        if expect_zero {
            assert!(
                cur.iter().all(|&v| v == 0.0),
                "a fresh gradient view is not zero: {cur:?}"
            );
        }
        let sum: Vec<f32> = cur.iter().zip(add).map(|(a, b)| a + b).collect();
        let bytes: Vec<u8> = sum.iter().flat_map(|v| v.to_le_bytes()).collect();
        if self.device {
            // SAFETY: the view holds as many bytes; staged before returning.
            unsafe { cu::memcpy_htod_async(t.data as u64, &bytes, self.stream) }.unwrap();
        } else {
            // SAFETY: fsdp's host view of as many bytes, writable until post_backward.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), t.data as *mut u8, bytes.len())
            };
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if !self.device {
            return;
        }
        // SAFETY: this host's allocations and stream, freed once after its work.
        unsafe {
            let _ = cu::stream::synchronize(self.stream);
            for &p in &self.allocs {
                let _ = cu::free_sync(p);
            }
            if !self.stream.is_null() {
                let _ = cu::stream::destroy(self.stream);
            }
        }
    }
}

/// Joins the threads world `name` as `rank` of `world`.
pub fn join(name: &str, rank: usize, world: usize) -> fsdp_group_t {
    let method = CString::new(format!("threads://{name}")).unwrap();
    let mut o = std::mem::MaybeUninit::uninit();
    let mut g = fsdp_group_t { id: 0 };
    // SAFETY: valid out-pointers; the string outlives the call.
    unsafe {
        must(fsdp_init_options_default(o.as_mut_ptr()));
        let mut o = o.assume_init();
        o.init_method = method.as_ptr();
        o.rank = rank as i32;
        o.world_size = world as i32;
        must(fsdp_init_process_group(&o, &mut g));
    }
    g
}

/// The MLP's model on `group`: on cuda:0 when `device`, bf16 mixed precision when `bf16`.
pub fn build(group: fsdp_group_t, device: bool, bf16: bool) -> Result<fsdp_model_t, fsdp_status> {
    build_on(group, if device { 2 } else { 1 }, 0, bf16)
}

fn build_on(
    group: fsdp_group_t,
    device_type: i32,
    id: i32,
    bf16: bool,
) -> Result<fsdp_model_t, fsdp_status> {
    let mut spec = fsdp_spec_t { id: 0 };
    let mut m = fsdp_model_t { id: 0 };
    // SAFETY: valid strings, shapes and values of the shapes' sizes; valid out-pointers.
    unsafe {
        must(fsdp_spec_new(&mut spec));
        for (k, (unit, o, i)) in [("0", HID, IN), ("2", OUT, HID)].into_iter().enumerate() {
            let u = CString::new(unit).unwrap();
            must(fsdp_spec_add_unit(spec, u.as_ptr()));
            for (name, shape) in [
                ("weight", vec![o as i64, i as i64]),
                ("bias", vec![o as i64]),
            ] {
                let n = shape.iter().product::<i64>() as usize;
                let v: Vec<f32> = values(31 + k as u64 * 2 + shape.len() as u64, n)
                    .iter()
                    .map(|x| x * 0.6)
                    .collect();
                let c = CString::new(name).unwrap();
                let (nd, sp) = (shape.len() as i32, shape.as_ptr());
                must(fsdp_spec_add_param(
                    spec,
                    u.as_ptr(),
                    c.as_ptr(),
                    nd,
                    sp,
                    v.as_ptr(),
                    true,
                ));
            }
        }
        let mut c = std::mem::MaybeUninit::uninit();
        must(fsdp_config_default(c.as_mut_ptr()));
        let mut c = c.assume_init();
        c.device = DLDevice {
            device_type,
            device_id: id,
        };
        c.mixed_precision = if bf16 {
            FSDP_PRECISION_BF16
        } else {
            FSDP_PRECISION_F32
        };
        let s = fsdp_model_new(group, spec, &c, &mut m);
        must(fsdp_spec_free(spec));
        if s != FSDP_OK {
            return Err(s);
        }
    }
    Ok(m)
}

fn unit(m: fsdp_model_t, name: &str) -> fsdp_unit_t {
    let mut u = fsdp_unit_t { id: 0 };
    let c = CString::new(name).unwrap();
    // SAFETY: valid string and out-pointer.
    must(unsafe { fsdp_model_unit(m, c.as_ptr(), &mut u) });
    u
}

/// y (n, o) = x (n, i) W^T + b.
fn linear(w: &[f32], b: &[f32], x: &[f32], n: usize, o: usize, i: usize) -> Vec<f32> {
    let mut y = vec![0.0; n * o];
    for r in 0..n {
        for j in 0..o {
            y[r * o + j] = b[j] + (0..i).map(|k| x[r * i + k] * w[j * i + k]).sum::<f32>();
        }
    }
    y
}

/// (dW = dy^T x, db = sum dy, dx = dy W).
fn linear_backward(
    w: &[f32],
    x: &[f32],
    dy: &[f32],
    n: usize,
    o: usize,
    i: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut dw, mut db, mut dx) = (vec![0.0; o * i], vec![0.0; o], vec![0.0; n * i]);
    for r in 0..n {
        for j in 0..o {
            let g = dy[r * o + j];
            db[j] += g;
            for k in 0..i {
                dw[j * i + k] += g * x[r * i + k];
                dx[r * i + k] += g * w[j * i + k];
            }
        }
    }
    (dw, db, dx)
}

/// One training step on rows `lo..hi` of step `s`; `offer` sees unit "0" in its backward
/// with the gradients about to be handed over (to try bad ones first). Returns the sum of
/// squared errors.
pub fn step(
    h: &mut Host,
    m: fsdp_model_t,
    s: usize,
    (lo, hi): (usize, usize),
    bf16: bool,
    offer: &mut dyn FnMut(&mut Host, fsdp_unit_t, &[DLTensor]),
) -> f32 {
    let (root, u0, u2) = (unit(m, ""), unit(m, "0"), unit(m, "2"));
    let n = hi - lo;
    let x: Vec<f32> = values(100 + s as u64, ROWS * IN)[lo * IN..hi * IN].to_vec();
    let t: Vec<f32> = values(200 + s as u64, ROWS * OUT)[lo * OUT..hi * OUT].to_vec();
    let st = h.stream();
    let null = std::ptr::null_mut();
    let mut p = [empty(); 2];
    let mut g = [empty(); 2];
    // SAFETY (every call below): arrays of 2 DLTensors, views read before their post hook.
    unsafe {
        must(fsdp_unit_pre_forward(root, true, null, 0, st));
        must(fsdp_unit_pre_forward(u0, true, p.as_mut_ptr(), 2, st));
        let want = if bf16 { (4, 16) } else { (2, 32) };
        assert_eq!(
            (p[0].dtype.code, p[0].dtype.bits),
            want,
            "parameter view dtype"
        );
        let (w0, b0) = (h.read(&p[0]), h.read(&p[1]));
        must(fsdp_unit_post_forward(u0, true, st));
        let hid = linear(&w0, &b0, &x, n, HID, IN);
        let a: Vec<f32> = hid.iter().map(|v| v.max(0.0)).collect();
        must(fsdp_unit_pre_forward(u2, true, p.as_mut_ptr(), 2, st));
        let (w2, b2) = (h.read(&p[0]), h.read(&p[1]));
        must(fsdp_unit_post_forward(u2, true, st));
        must(fsdp_unit_post_forward(root, true, st));
        let y = linear(&w2, &b2, &a, n, OUT, HID);
        let dy: Vec<f32> = y
            .iter()
            .zip(&t)
            .map(|(y, t)| 2.0 * (y - t) / (n * OUT) as f32)
            .collect();
        let sse = y.iter().zip(&t).map(|(y, t)| (y - t) * (y - t)).sum();
        must(fsdp_unit_pre_backward(root, null, null, 0, st));
        must(fsdp_unit_pre_backward(
            u2,
            p.as_mut_ptr(),
            g.as_mut_ptr(),
            2,
            st,
        ));
        assert_eq!(
            (g[0].dtype.code, g[0].dtype.bits),
            (2, 32),
            "gradient views are f32"
        );
        let (dw2, db2, da) = linear_backward(&h.read(&p[0]), &a, &dy, n, OUT, HID);
        h.add_into(&g[0], &dw2, true);
        h.add_into(&g[1], &db2, true);
        must(fsdp_unit_post_backward(u2, std::ptr::null(), 0, true, st));
        let da: Vec<f32> = da
            .iter()
            .zip(&hid)
            .map(|(d, h)| if *h > 0.0 { *d } else { 0.0 })
            .collect();
        must(fsdp_unit_pre_backward(u0, p.as_mut_ptr(), null, 2, st));
        let (dw0, db0, _) = linear_backward(&h.read(&p[0]), &x, &da, n, HID, IN);
        let mine = [
            h.tensor(&dw0, &[HID, IN], bf16),
            h.tensor(&db0, &[HID], bf16),
        ];
        offer(h, u0, &mine);
        must(fsdp_unit_post_backward(u0, mine.as_ptr(), 2, true, st));
        must(fsdp_unit_post_backward(root, null, 0, true, st));
        must(fsdp_model_finish_backward(m, st));
        sse
    }
}

fn empty() -> DLTensor {
    DLTensor {
        data: std::ptr::null_mut(),
        device: DLDevice {
            device_type: 1,
            device_id: 0,
        },
        ndim: 0,
        dtype: DLDataType {
            code: 2,
            bits: 32,
            lanes: 1,
        },
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

unsafe extern "C" fn collect(ctx: *mut c_void, name: *const c_char, t: *const DLTensor) -> i32 {
    // SAFETY: ctx is the Vec below; name and t live during the call (host memory, f32).
    unsafe {
        let out = &mut *(ctx as *mut Vec<(String, Vec<f32>)>);
        let t = &*t;
        let n: usize = (0..t.ndim as usize)
            .map(|i| *t.shape.add(i) as usize)
            .product();
        let v = std::slice::from_raw_parts(t.data as *const f32, n).to_vec();
        out.push((CStr::from_ptr(name).to_string_lossy().into_owned(), v));
    }
    0
}

/// One rank's training: its full parameters and losses after `STEPS` steps.
fn train_rank(
    name: &str,
    rank: usize,
    world: usize,
    device: bool,
    bf16: bool,
) -> (Vec<(String, Vec<f32>)>, Vec<f32>) {
    // Rank 1 uses the legacy default stream (NULL), rank 0 a stream of its own.
    let mut h = Host::new(device, rank == 1);
    let g = join(name, rank, world);
    let m =
        build(g, device, bf16).unwrap_or_else(|s| panic!("{}: {}", status_name(s), last_error()));
    let st = h.stream();
    let mut oc = std::mem::MaybeUninit::uninit();
    let mut opt = fsdp_optimizer_t { id: 0 };
    let (mut params, mut losses) = (Vec::new(), Vec::new());
    // SAFETY: valid out-pointers and tensors.
    unsafe {
        must(fsdp_optimizer_config_default(
            FSDP_OPTIM_SGD,
            oc.as_mut_ptr(),
        ));
        let mut oc = oc.assume_init();
        oc.lr = 0.1;
        oc.momentum = 0.9;
        must(fsdp_optimizer_new(m, &oc, &mut opt));
        let rows = (rank * ROWS / world, (rank + 1) * ROWS / world);
        for s in 0..STEPS {
            let sse = step(&mut h, m, s, rows, bf16, &mut |_, _, _| {});
            let mut norm = 0.0f32;
            must(fsdp_model_clip_grad_norm(m, 0.5, 2.0, &mut norm, st));
            must(fsdp_optimizer_step(opt, st));
            must(fsdp_model_zero_grad(m));
            let mut l = h.tensor(&[sse], &[1], false);
            must(fsdp_all_reduce(g, &mut l, FSDP_REDUCE_SUM, st));
            losses.push(h.read(&l)[0] / (ROWS * OUT) as f32);
        }
        let ctx = &mut params as *mut Vec<(String, Vec<f32>)> as *mut c_void;
        must(fsdp_model_full_state_dict(m, false, Some(collect), ctx, st));
        must(fsdp_optimizer_free(opt));
        must(fsdp_model_free(m));
        must(fsdp_destroy_process_group(g));
    }
    (params, losses)
}

/// `train_rank` on `world` threads; rank 0's result.
fn train(world: usize, device: bool, bf16: bool) -> (Vec<(String, Vec<f32>)>, Vec<f32>) {
    let name = format!("capi-cuda-{world}-{device}-{bf16}");
    std::thread::scope(|sc| {
        let ranks: Vec<_> = (0..world)
            .map(|r| {
                let name = name.clone();
                sc.spawn(move || train_rank(&name, r, world, device, bf16))
            })
            .collect();
        let mut out: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        out.swap_remove(0)
    })
}

/// The device run equals the CPU run of the same host (f32 1e-6; bf16 the same: the host
/// computes identically and fsdp's casts and bf16 reductions round alike on both).
pub fn train_matches_cpu(world: usize, bf16: bool) {
    let (cpu, cpu_losses) = train(world, false, bf16);
    let (gpu, gpu_losses) = train(world, true, bf16);
    let what = |n: &str| format!("world {world} bf16 {bf16}: {n}");
    assert_eq!(cpu.len(), 4);
    for ((n, want), (m, got)) in cpu.iter().zip(&gpu) {
        assert_eq!(n, m);
        assert_close(&what(n), got, want, 1e-6, 1e-6);
    }
    assert_close(&what("losses"), &gpu_losses, &cpu_losses, 1e-6, 1e-6);
    assert!(
        gpu_losses[STEPS - 1] < gpu_losses[0],
        "{}: {gpu_losses:?}",
        what("loss")
    );
    println!("{}: ok, losses {gpu_losses:?}", what("device = cpu"));
}

/// all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast on device
/// buffers at world size 2: the host uploads the input on its stream right before the call
/// and reads the result on its stream right after.
pub fn collectives() {
    let out: Vec<Vec<Vec<f32>>> = std::thread::scope(|sc| {
        let ranks: Vec<_> = (0..2)
            .map(|r| sc.spawn(move || collectives_rank(r)))
            .collect();
        ranks.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let v = |seed: u64, n| values(seed, n);
    for (r, got) in out.iter().enumerate() {
        let sum: Vec<f32> = v(1, 6).iter().zip(v(2, 6)).map(|(a, b)| a + b).collect();
        assert_close("all_reduce", &got[0], &sum, 1e-6, 1e-6);
        assert_eq!(
            got[1],
            [v(10, 4), v(11, 4)].concat(),
            "all_gather_into_tensor"
        );
        let avg: Vec<f32> = v(20, 8)
            .iter()
            .zip(v(21, 8))
            .map(|(a, b)| (a + b) / 2.0)
            .collect();
        assert_close(
            "reduce_scatter_tensor",
            &got[2],
            &avg[r * 4..r * 4 + 4],
            1e-6,
            1e-6,
        );
        assert_eq!(got[3], v(31, 5), "broadcast from rank 1");
    }
}

fn collectives_rank(r: usize) -> Vec<Vec<f32>> {
    let mut h = Host::new(true, r == 1);
    let g = join("capi-cuda-collectives", r, 2);
    let st = h.stream();
    let mut res = Vec::new();
    // SAFETY: tensors of the host, alive until the host drops.
    unsafe {
        let mut t = h.tensor(&values(1 + r as u64, 6), &[2, 3], false);
        must(fsdp_all_reduce(g, &mut t, FSDP_REDUCE_SUM, st));
        res.push(h.read(&t));
        let i = h.tensor(&values(10 + r as u64, 4), &[4], false);
        let mut o = h.tensor(&[0.0; 8], &[8], false);
        must(fsdp_all_gather_into_tensor(g, &mut o, &i, st));
        res.push(h.read(&o));
        let i = h.tensor(&values(20 + r as u64, 8), &[8], false);
        let mut o = h.tensor(&[0.0; 4], &[4], false);
        must(fsdp_reduce_scatter_tensor(
            g,
            &mut o,
            &i,
            FSDP_REDUCE_AVG,
            st,
        ));
        res.push(h.read(&o));
        let mut t = h.tensor(&values(30 + r as u64, 5), &[5], false);
        must(fsdp_broadcast(g, &mut t, 1, st));
        res.push(h.read(&t));
        must(fsdp_destroy_process_group(g));
    }
    res
}

/// A CUDA gradient for a CPU model, a host gradient or one of another device_id for a
/// model on cuda:0, a model on a device that does not exist, a collective across devices:
/// each a status naming the problem; the step then goes on with the right tensors.
pub fn wrong_devices() {
    let g = join("capi-cuda-wrong-devices", 0, 1);
    let mut gpu = Host::new(true, false);
    let on_gpu = gpu.tensor(&[0.0; HID * IN], &[HID, IN], false);
    // A CPU model offered device memory.
    let mut cpu = Host::new(false, false);
    let m = build(g, false, false).unwrap();
    step(&mut cpu, m, 0, (0, 4), false, &mut |_, u0, mine| {
        let bad = [on_gpu, mine[1]];
        // SAFETY: two valid DLTensors.
        let s = unsafe { fsdp_unit_post_backward(u0, bad.as_ptr(), 2, true, std::ptr::null_mut()) };
        fails(s, "FSDP_ERR_DEVICE_MISMATCH", "grads[0] ('0.weight'): a CUDA tensor (kDLCUDA, device_id 0), but the model computes on the CPU");
    });
    must(fsdp_model_free(m));
    // A model on cuda:0 offered host memory and another device's.
    let m = build(g, true, false).unwrap();
    let host_grad = cpu.tensor(&[0.0; HID * IN], &[HID, IN], false);
    let st = gpu.stream();
    step(&mut gpu, m, 0, (0, 4), false, &mut |_, u0, mine| {
        let bad = [host_grad, mine[1]];
        // SAFETY: two valid DLTensors.
        let s = unsafe { fsdp_unit_post_backward(u0, bad.as_ptr(), 2, true, st) };
        fails(s, "FSDP_ERR_DEVICE_MISMATCH", "grads[0] ('0.weight'): a host tensor (kDLCPU), but the model computes on cuda:0: pass device memory of cuda:0");
        let mut other = mine[0];
        other.device.device_id = 1;
        let bad = [mine[0], other];
        // SAFETY: as above.
        let s = unsafe { fsdp_unit_post_backward(u0, bad.as_ptr(), 2, true, st) };
        fails(s, "FSDP_ERR_DEVICE_MISMATCH", "grads[1] ('0.bias'): a CUDA tensor (kDLCUDA, device_id 1), but the model computes on cuda:0");
    });
    must(fsdp_model_free(m));
    // A device the driver does not have.
    let s = build_on(g, 2, 99, false).unwrap_err();
    fails(s, "FSDP_ERR_CUDA", "cuda:99");
    // A collective across devices.
    let input = gpu.tensor(&[1.0; 4], &[4], false);
    let mut output = gpu.tensor(&[0.0; 4], &[4], false);
    output.device.device_id = 1;
    // SAFETY: valid DLTensors (refused before any access).
    let s = unsafe { fsdp_all_gather_into_tensor(g, &mut output, &input, st) };
    fails(
        s,
        "FSDP_ERR_DEVICE_MISMATCH",
        "input: a CUDA tensor (kDLCUDA, device_id 0), but output is on cuda:1",
    );
    must(fsdp_destroy_process_group(g));
}
