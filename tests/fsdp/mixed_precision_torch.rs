//! Parity with PyTorch 2.11 FSDP1 under `MixedPrecision` (issue 15, point 2): per-step
//! losses and final parameters of a small MLP, every sharding strategy, world sizes 1-4,
//! SGD and Adam, in f32 and with `param_dtype` bf16 / f16 (`reduce_dtype` f32), against
//! `tests/torch_ref/mixed_precision_refs.safetensors` (made by
//! `tests/torch_ref/make_mixed_precision_refs.py` with real FSDP1 on CPU and gloo; how,
//! in its docstring).
//!
//! The bf16 / f16 cases compare against PyTorch's low-precision numbers: real
//! low-precision compute, every layer output and activation gradient rounded to
//! `param_dtype` where PyTorch rounds (`tests/torch_ref/mixed_precision_rounding.md`,
//! `crate::ops`' low-precision paths). Their tolerance is explained at [`lp_tol_ulps`].
//! The `_cuda` variant runs the bf16 and f16 cases on device tensors (`device_id` cuda:0;
//! skipped without a GPU or cuda-emu) against the same references and bounds.

use crate::common;
use crate::mp_mlp;

use fsdp::backend::Device;
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    module_wrap_policy, FsdpConfig, FullyShardedDataParallel, MixedPrecision, ShardingStrategy,
};
use fsdp::nn::{loss, Context, Module};
use mp_mlp::{batch, init_params, model, optimizer, IN, OUT, ROWS};

use fsdp::tensor::{DType, Tensor};
use safetensors::SafeTensors;
use std::collections::HashMap;

const STEPS: usize = 4;

const STRATEGIES: [(ShardingStrategy, &str); 5] = [
    (ShardingStrategy::FullShard, "FULL_SHARD"),
    (ShardingStrategy::ShardGradOp, "SHARD_GRAD_OP"),
    (ShardingStrategy::NoShard, "NO_SHARD"),
    (ShardingStrategy::HybridShard, "HYBRID_SHARD"),
    (ShardingStrategy::HybridShardZero2, "_HYBRID_SHARD_ZERO2"),
];
const OPTIMIZERS: [&str; 2] = ["sgd", "adam"];

// ------------------------------------------------------------------ the reference file

struct Refs {
    bytes: Vec<u8>,
    meta: HashMap<String, String>,
}

impl Refs {
    fn load() -> Refs {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/torch_ref/mixed_precision_refs.safetensors"
        );
        let bytes = std::fs::read(path).unwrap();
        let (_, m) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta = m.metadata().clone().unwrap();
        Refs { bytes, meta }
    }

    fn get(&self, key: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{key}");
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    fn json<T: serde::de::DeserializeOwned>(&self, key: &str) -> T {
        serde_json::from_str(&self.meta[key]).unwrap()
    }

    /// PyTorch parameter names, in `named_parameters()` order.
    fn names(&self) -> Vec<String> {
        self.json("names")
    }

    /// Ranks per node the reference's hybrid runs used at `world`.
    fn hybrid_rpn(&self, world: usize) -> usize {
        let m: HashMap<String, usize> = self.json("hybrid_ranks_per_node");
        m[&world.to_string()]
    }
}

// ------------------------------------------------------------------ runs

#[derive(Clone, Copy, Debug, PartialEq)]
enum Prec {
    F32,
    Bf16,
    F16,
}

impl Prec {
    fn key(self) -> &'static str {
        match self {
            Prec::F32 => "f32",
            Prec::Bf16 => "bf16",
            Prec::F16 => "f16",
        }
    }

    /// `MixedPrecision(param_dtype=d, reduce_dtype=float32, buffer_dtype=d)`.
    fn policy(self) -> Option<MixedPrecision> {
        let d = match self {
            Prec::F32 => return None,
            Prec::Bf16 => DType::BF16,
            Prec::F16 => DType::F16,
        };
        Some(MixedPrecision {
            param_dtype: Some(d),
            reduce_dtype: Some(DType::F32),
            buffer_dtype: Some(d),
            ..MixedPrecision::default()
        })
    }
}

/// One rank's result: its loss at every step, and the full parameters (flat, in
/// `named_parameters()` order) with their names.
struct RankRun {
    losses: Vec<f32>,
    names: Vec<String>,
    params: Vec<f32>,
}

fn run(
    refs: &Refs,
    prec: Prec,
    strategy: ShardingStrategy,
    opt: &str,
    world: usize,
    dev: Device,
) -> Vec<RankRun> {
    let rpn = refs.hybrid_rpn(world);
    launch(&LaunchOptions::new(world), |pg| {
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            auto_wrap_policy: Some(module_wrap_policy(["Linear"])),
            ranks_per_node: strategy.is_hybrid().then_some(rpn),
            mixed_precision: prec.policy(),
            device_id: (dev != Device::Cpu).then_some(dev),
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(model(), pg.clone(), cfg)?;
        let mut o = optimizer(opt);
        let rows = ROWS / world;
        let (lo, hi) = (pg.rank() * rows, (pg.rank() + 1) * rows);
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let (x, t) = batch(s);
            let x = Tensor::from_vec(x[lo * IN..hi * IN].to_vec(), &[rows, IN])?.to_device(dev)?;
            let t =
                Tensor::from_vec(t[lo * OUT..hi * OUT].to_vec(), &[rows, OUT])?.to_device(dev)?;
            let out = m.forward(&x, &Context::train())?;
            let (l, g) = loss::mse_loss(&out, &t)?;
            m.backward(&g, &Context::train())?;
            o.step(&m.optimizer_params())?;
            m.zero_grad();
            losses.push(l);
        }
        let full = m.full_parameters()?;
        Ok(RankRun {
            losses,
            names: full.iter().map(|(n, _)| n.clone()).collect(),
            params: full.into_iter().flat_map(|(_, v)| v).collect(),
        })
    })
    .unwrap()
}

// ------------------------------------------------------------------ comparison

/// One bf16/f16 ulp at `v`: the spacing of `param_dtype` values around `|v|` (the
/// subnormal spacing below the smallest normal).
fn lp_ulp(v: f32, prec: Prec) -> f32 {
    let (mant, min_exp) = match prec {
        Prec::Bf16 => (7, -126),
        Prec::F16 => (10, -14),
        Prec::F32 => (23, -126),
    };
    mp_mlp::ulp(v, mant, min_exp)
}

/// Deviations of one case from PyTorch over every rank. `p_ulps` and `l_ulps` are in
/// `param_dtype` ulps of the reference value, values below 1/16 counted as 1/16 (see
/// [`LP_TOL_ULPS`]); `p_frac` is the fraction of parameter values off by more than 1/8 of
/// such an ulp.
#[derive(Default, Debug, Clone, Copy)]
struct Dev {
    p_abs: f32,
    p_rel: f32,
    p_ulps: f32,
    p_frac: f32,
    l_abs: f32,
    l_rel: f32,
    l_ulps: f32,
}

/// Values below this count as this in the ulp units (the parameters are 0.05-1.1, the
/// losses 0.005-2.7).
const ULP_FLOOR: f32 = 1.0 / 16.0;

fn deviation(refs: &Refs, key: &str, ranks: &[RankRun], prec: Prec) -> Dev {
    let want_p = refs.get(&format!("{key}/params"));
    let want_l = refs.get(&format!("{key}/losses")); // [steps, world]
    let names = refs.names();
    let world = ranks.len();
    let mut d = Dev::default();
    let mut over = 0usize;
    for (r, rr) in ranks.iter().enumerate() {
        assert_eq!(rr.names, names, "{key}: parameter names");
        assert_eq!(rr.params.len(), want_p.len(), "{key}: parameter count");
        for (&g, &w) in rr.params.iter().zip(&want_p) {
            let e = (g - w).abs();
            let u = e / lp_ulp(w.abs().max(ULP_FLOOR), prec);
            d.p_abs = d.p_abs.max(e);
            d.p_rel = d.p_rel.max(e / w.abs().max(1e-3));
            d.p_ulps = d.p_ulps.max(u);
            over += usize::from(u > 0.125);
        }
        for (s, &g) in rr.losses.iter().enumerate() {
            let w = want_l[s * world + r];
            let e = (g - w).abs();
            d.l_abs = d.l_abs.max(e);
            d.l_rel = d.l_rel.max(e / w.abs().max(1e-3));
            d.l_ulps = d.l_ulps.max(e / lp_ulp(w.abs().max(ULP_FLOOR), prec));
        }
    }
    d.p_frac = over as f32 / (world * want_p.len()) as f32;
    d
}

/// Runs every strategy x optimizer x world size 1-4 at `prec`, prints each case's
/// deviations from PyTorch and returns the cases with them.
fn all_cases(prec: Prec) -> Vec<(String, Dev)> {
    all_cases_on(prec, Device::Cpu)
}

/// [`all_cases`] with the model on `dev`.
fn all_cases_on(prec: Prec, dev: Device) -> Vec<(String, Dev)> {
    let refs = Refs::load();
    let mut out = Vec::new();
    for (strategy, sname) in STRATEGIES {
        for opt in OPTIMIZERS {
            for world in 1..=4 {
                let key = format!("{}/{sname}/{opt}/w{world}", prec.key());
                let ranks = run(&refs, prec, strategy, opt, world, dev);
                let d = deviation(&refs, &key, &ranks, prec);
                eprintln!(
                    "{key}: params abs {:.2e} rel {:.2e} = {:.3} ulps, {:.1}% > 1/8 ulp; losses abs {:.2e} rel {:.2e} = {:.3} ulps",
                    d.p_abs,
                    d.p_rel,
                    d.p_ulps,
                    100.0 * d.p_frac,
                    d.l_abs,
                    d.l_rel,
                    d.l_ulps
                );
                out.push((key, d));
            }
        }
    }
    out
}

// ------------------------------------------------------------------ tests

#[test]
fn reference_file_holds_the_closed_form_model_and_data() {
    let refs = Refs::load();
    assert_eq!(refs.meta["torch_version"].split('+').next(), Some("2.11.0"));
    let want: Vec<f32> = init_params().into_iter().flat_map(|(_, v)| v).collect();
    assert_eq!(refs.get("init/params"), want, "closed-form parameters");
    let names: Vec<String> = init_params().iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(refs.names(), names);
    let (xs, ts): (Vec<_>, Vec<_>) = (0..STEPS).map(batch).unzip();
    assert_eq!(refs.get("data/x"), xs.concat(), "closed-form inputs");
    assert_eq!(refs.get("data/t"), ts.concat(), "closed-form targets");
    // The model this file builds starts from those values.
    let mut m = model();
    let got: Vec<f32> = common::named_values(m.as_mut())
        .into_iter()
        .flat_map(|(_, v)| v)
        .collect();
    assert_eq!(got, want);
}

#[test]
fn f32_training_matches_pytorch_fsdp_every_strategy_world_1_to_4() {
    // f32 against f32: the same operations summed in other orders (GEMM blocking, the
    // collectives' reduction order). Measured: parameters within 1.2e-7, losses within
    // 4.8e-7 (a few f32 ulps); 1e-6 leaves room for another GEMM kernel and is far below
    // any difference in what is computed.
    let mut worst = Dev::default();
    for (key, d) in all_cases(Prec::F32) {
        assert!(
            d.p_abs <= 1e-6 && d.l_abs <= 1e-6,
            "{key}: parameters {:.2e}, losses {:.2e} from PyTorch (tolerance 1e-6)",
            d.p_abs,
            d.l_abs
        );
        worst.p_abs = worst.p_abs.max(d.p_abs);
        worst.l_abs = worst.l_abs.max(d.l_abs);
    }
    eprintln!(
        "f32: worst parameter {:.2e}, loss {:.2e}",
        worst.p_abs, worst.l_abs
    );
}

/// Tolerance of the bf16 / f16 cases on every final parameter, in `param_dtype` ulps of
/// `max(|reference|, 1/16)` (one bf16 ulp is 2^-9 = 2.0e-3 at 0.3 and 4.9e-4 below 1/16;
/// f16's are 8x smaller): 1 ulp after SGD, 1/16 ulp after Adam (whose normalized steps
/// barely move when the gradients move, so it needs the finer bound).
///
/// What "f32 rounding of the same bf16 operations" can move, measured with an emulator of
/// PyTorch's numerics (a float64 or float32 re-implementation of this model that rounds to
/// `param_dtype` exactly where PyTorch does: `tests/torch_ref/emulate_mixed_precision.py`),
/// over the 20 cases
/// of each dtype and optimizer:
/// - bf16: the emulator equals PyTorch bit for bit on every parameter, in float64 and in
///   float32 (summation orders other than PyTorch's): rounding every op output to 8 bits
///   absorbs f32-level differences. Deviation 0.
/// - f16: SGD at most 0.76 ulps, on at most 1.6% of the values; Adam 0.014 ulps. The cause
///   is PyTorch's CPU GELU, whose 1.5e-7 erf approximation rounds ~1% of f16 inputs below
///   -3 to the other neighbour.
///
/// What moving ONE rounding point does (each of: a linear layer rounded before and after
/// its bias, GELU or LayerNorm output not rounded, LayerNorm rounded between normalizing
/// and the affine, LayerNorm backward with f32 instead of rounded saved mean/rstd, its
/// weight/bias gradients summed in f32 instead of row by row in `param_dtype`, activation
/// gradients, parameter gradients, the loss gradient or the root input not rounded): the
/// worst SGD case moves some parameter by 1.61 to 5.3 bf16 ulps (1.72 to 5.4 f16 ulps)
/// and 15-52% of its values by more than 1/8 ulp; the worst Adam case by 0.14 to 0.89
/// bf16 ulps (0.14 to 1.04 f16 ulps). Both bounds sit between the two: above everything
/// the same operations give, below every moved rounding point. Today's code (f32
/// activations, rounded GEMM operands) is 1.9-5.4 ulps off after SGD, 0.30-0.93 after Adam.
fn lp_tol_ulps(opt: &str) -> f32 {
    if opt == "adam" {
        1.0 / 16.0
    } else {
        1.0
    }
}

/// At most this fraction of a case's parameter values may be off by more than 1/8 ulp
/// (same units as [`lp_tol_ulps`]): same operations <= 1.6%, one moved rounding point
/// 15-52% in its worst SGD case.
const LP_TOL_FRAC: f32 = 0.05;

/// Losses (each rank, each step) within 2 ulps of `max(loss, 1/16)`: a rounding flip of
/// one output element moves a small loss by ~1 ulp (f16 emulator: 1.06), so losses are a
/// sanity check here, the parameters are the tight one.
const LP_TOL_LOSS_ULPS: f32 = 2.0;

fn low_precision_matches_pytorch(prec: Prec) {
    low_precision_matches_pytorch_on(prec, Device::Cpu);
}

fn low_precision_matches_pytorch_on(prec: Prec, dev: Device) {
    let cases = all_cases_on(prec, dev);
    let bad: Vec<_> = cases
        .iter()
        .filter(|(key, d)| {
            let opt = key.split('/').nth(2).unwrap();
            d.p_ulps > lp_tol_ulps(opt) || d.p_frac > LP_TOL_FRAC || d.l_ulps > LP_TOL_LOSS_ULPS
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} {} cases deviate from PyTorch beyond 1 ulp (SGD) / 1/16 ulp (Adam), {LP_TOL_FRAC} of the values, or losses {LP_TOL_LOSS_ULPS} ulps: {bad:?}",
        bad.len(),
        cases.len(),
        prec.key()
    );
}

#[test]
fn bf16_training_matches_pytorch_fsdp_every_strategy_world_1_to_4() {
    low_precision_matches_pytorch(Prec::Bf16);
}

#[test]
fn f16_training_matches_pytorch_fsdp_every_strategy_world_1_to_4() {
    low_precision_matches_pytorch(Prec::F16);
}

/// The same bf16 and f16 cases on device tensors (every rank on cuda:0): the layers'
/// kernels (cuBLAS products, the `lowp.cu` LayerNorm backward, the pack kernels) must round
/// where PyTorch does too. Skipped, passing, without a usable GPU.
#[test]
fn bf16_and_f16_training_on_cuda_match_pytorch_fsdp_cuda() {
    if let Err(e) = fsdp::backend::cuda::detect() {
        eprintln!("skipping bf16_and_f16_training_on_cuda_match_pytorch_fsdp_cuda on CUDA: {e}");
        return;
    }
    low_precision_matches_pytorch_on(Prec::Bf16, Device::Cuda(0));
    low_precision_matches_pytorch_on(Prec::F16, Device::Cuda(0));
}
