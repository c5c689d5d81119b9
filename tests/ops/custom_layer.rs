//! Issue 18, point 3: the ops a custom layer is made of (`fsdp::ops` `arith.rs`, `axis.rs`,
//! `mm`), checked against finite differences, and the residual MLP of the user report
//! written with them and no host loop: its forward and gradients equal PyTorch's
//! (`tests/torch_ref/make_module_refs.py`), and training it under FSDP at world sizes 1
//! and 2 gives the parameters of unsharded training.

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel};
use fsdp::nn::{
    self, ChildVisitor, Context, InitKey, Linear, Module, ParamVisitor, Parameter, ReLU, Sequential,
};
use fsdp::ops::{self, Pointwise, Transpose};
use fsdp::optim::{Optimizer, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};
use fsdp::{Error, Result};
use std::path::Path;

use crate::common;

use common::MODULE_REFS as REFS;

// ---------------------------------------------------------------------------------------
// Finite-difference checks of each op's backward helper.

fn randt(seed: u64, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(common::values(seed, shape.iter().product()), shape)
}

/// An op of several inputs.
type Op<'a> = &'a dyn Fn(&[Tensor]) -> Result<Tensor>;
/// Its backward: `(dy, inputs) -> d inputs`.
type Backward<'a> = &'a dyn Fn(&Tensor, &[Tensor]) -> Result<Vec<Tensor>>;

/// `L(xs) = sum(f(xs) * r)` in f64.
fn loss(f: Op<'_>, xs: &[Tensor], r: &[f32]) -> Result<f64> {
    let y = f(xs)?.to_vec_f32()?;
    Ok(y.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum())
}

/// Checks `grads` (the analytic gradient of `L` for each input, given `dy = r`) against
/// central differences of `L`.
fn gradcheck(what: &str, f: Op<'_>, back: Backward<'_>, xs: Vec<Tensor>) -> Result<()> {
    let y = f(&xs)?;
    let r = randt(99, y.shape())?;
    let grads = back(&r, &xs)?;
    assert_eq!(grads.len(), xs.len(), "{what}");
    let rv = r.to_vec_f32()?;
    for (i, (x, g)) in xs.iter().zip(&grads).enumerate() {
        assert_eq!(
            g.shape(),
            x.shape(),
            "{what}: gradient {i} has the input's shape"
        );
        let g = g.to_vec_f32()?;
        let base = x.to_vec_f32()?;
        for j in 0..base.len() {
            let eps = 1e-2f32;
            let at = |d: f32| -> Result<f64> {
                let mut v = base.clone();
                v[j] += d;
                let mut ys = xs.clone();
                ys[i] = Tensor::from_vec(v, x.shape())?;
                loss(f, &ys, &rv)
            };
            let num = (at(eps)? - at(-eps)?) / (2.0 * eps as f64);
            let a = g[j] as f64;
            assert!(
                (a - num).abs() <= 1e-2 * a.abs().max(num.abs()) + 2e-3,
                "{what}: d/d input {i}[{j}]: analytic {a}, numeric {num}"
            );
        }
    }
    Ok(())
}

#[test]
fn broadcast_arithmetic_matches_finite_differences() -> Result<()> {
    let shapes: [(&[usize], &[usize]); 5] = [
        (&[3, 4], &[3, 4]),
        (&[3, 4], &[4]),
        (&[2, 3, 4], &[3, 1]),
        (&[5, 1], &[1, 3]),
        (&[1], &[2, 3]),
    ];
    for (sa, sb) in shapes {
        let xs = || -> Result<Vec<Tensor>> { Ok(vec![randt(1, sa)?, randt(2, sb)?]) };
        gradcheck(
            "mul",
            &|x| ops::mul(&x[0], &x[1]),
            &|dy, x| ops::mul_backward(dy, &x[0], &x[1]).map(|(a, b)| vec![a, b]),
            xs()?,
        )?;
        gradcheck(
            "sub",
            &|x| ops::sub(&x[0], &x[1]),
            &|dy, x| ops::sub_backward(dy, x[0].shape(), x[1].shape()).map(|(a, b)| vec![a, b]),
            xs()?,
        )?;
        // Divisors away from 0: 1.5 + [-1, 1).
        let b = Tensor::from_vec(
            common::values(3, sb.iter().product())
                .iter()
                .map(|v| v + 1.5)
                .collect(),
            sb,
        )?;
        gradcheck(
            "div",
            &|x| ops::div(&x[0], &x[1]),
            &|dy, x| ops::div_backward(dy, &x[0], &x[1]).map(|(a, b)| vec![a, b]),
            vec![randt(1, sa)?, b],
        )?;
    }
    // Broadcasting follows PyTorch: (5, 1) * (1, 3) is (5, 3); (2, 3) and (3, 2) do not.
    assert_eq!(
        ops::mul(&randt(1, &[5, 1])?, &randt(2, &[1, 3])?)?.shape(),
        [5, 3]
    );
    assert!(matches!(
        ops::mul(&randt(1, &[2, 3])?, &randt(2, &[3, 2])?),
        Err(Error::ShapeMismatch { op: "mul", .. })
    ));
    Ok(())
}

#[test]
fn mm_with_every_transpose_matches_finite_differences() -> Result<()> {
    let (m, k, n) = (3, 4, 5);
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let t = Transpose { a: ta, b: tb };
        let sa = if ta { [k, m] } else { [m, k] };
        let sb = if tb { [n, k] } else { [k, n] };
        gradcheck(
            &format!("mm {t:?}"),
            &|x| ops::mm(&x[0], &x[1], t),
            &|dy, x| ops::mm_backward(dy, &x[0], &x[1], t).map(|(a, b)| vec![a, b]),
            vec![randt(4, &sa)?, randt(5, &sb)?],
        )?;
    }
    // Leading dimensions of `a` are rows: (2, 3, 4) @ (4, 5) is (2, 3, 5).
    let y = ops::mm(&randt(1, &[2, 3, 4])?, &randt(2, &[4, 5])?, Transpose::NN)?;
    assert_eq!(y.shape(), [2, 3, 5]);
    assert!(matches!(
        ops::mm(&randt(1, &[3, 4])?, &randt(2, &[5, 5])?, Transpose::NN),
        Err(Error::ShapeMismatch { op: "mm", .. })
    ));
    Ok(())
}

#[test]
fn reductions_cat_and_split_match_finite_differences() -> Result<()> {
    let shape = [2, 3, 4];
    for dim in [0isize, 1, 2, -1] {
        for keepdim in [false, true] {
            for mean in [false, true] {
                gradcheck(
                    &format!("sum/mean dim {dim} keepdim {keepdim} mean {mean}"),
                    &|x| match mean {
                        true => ops::mean_dim(&x[0], dim, keepdim),
                        false => ops::sum_dim(&x[0], dim, keepdim),
                    },
                    &|dy, x| ops::sum_dim_backward(dy, x[0].shape(), dim, mean).map(|g| vec![g]),
                    vec![randt(6, &shape)?],
                )?;
            }
        }
        let d = ops::normalize_dim("test", dim, 3)?;
        let mut s2 = shape;
        s2[d] = 1;
        gradcheck(
            &format!("cat dim {dim}"),
            &|x| ops::cat(&[&x[0], &x[1]], dim),
            &|dy, x| ops::cat_backward(dy, &[x[0].shape()[d], x[1].shape()[d]], dim),
            vec![randt(7, &shape)?, randt(8, &s2)?],
        )?;
        let n = shape[d];
        gradcheck(
            &format!("split dim {dim}"),
            // Both pieces reach the loss: their concatenation in reverse order.
            &|x| {
                let p = ops::split(&x[0], &[1, n - 1], dim)?;
                ops::cat(&[&p[1], &p[0]], dim)
            },
            &|dy, _| {
                let g = ops::split(dy, &[n - 1, 1], dim)?;
                ops::split_backward(&[&g[1], &g[0]], dim).map(|g| vec![g])
            },
            vec![randt(9, &shape)?],
        )?;
    }
    // Errors are clear: a bad dimension, sizes that do not add up, mismatched shapes.
    let x = randt(1, &[2, 3])?;
    assert!(
        matches!(ops::sum_dim(&x, 2, false), Err(Error::InvalidArgument(m)) if m.contains("out of range"))
    );
    assert!(
        matches!(ops::split(&x, &[1, 1], 1), Err(Error::InvalidArgument(m)) if m.contains("add up"))
    );
    // Sizes whose sum overflows must not wrap around to the dimension's size.
    assert!(matches!(
        ops::split(&x, &[usize::MAX, 4], 1),
        Err(Error::InvalidArgument(m)) if m.contains("add up")
    ));
    // add broadcasts as torch.add (it used to add two different shapes element by element).
    let row = randt(3, &[3])?;
    let sum = ops::add(&x, &row)?;
    assert_eq!(sum.shape(), &[2, 3]);
    let (xv, rv) = (x.to_vec_f32()?, row.to_vec_f32()?);
    let want: Vec<f32> = (0..6).map(|i| xv[i] + rv[i % 3]).collect();
    assert_eq!(sum.to_vec_f32()?, want);
    assert!(matches!(
        ops::add(&x, &randt(4, &[3, 2])?),
        Err(Error::InvalidArgument(_) | Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        ops::cat(&[&x, &randt(2, &[3, 3])?], 1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(
        ops::mean_dim(&Tensor::zeros(&[2, 0], DType::F32), 1, false)?
            .to_vec_f32()?
            .iter()
            .all(|v| v.is_nan())
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The residual MLP of the report, as a custom layer.

/// `u = x @ w_in^T + b_in; a, g = split(u, [h, h]); v = a * relu(g);`
/// `y = x + (v @ w_out^T) * gate; out = y - mean(y, -1)`; `x (n, d)`.
struct ResidualMlp {
    h: usize,
    w_in: Parameter,
    b_in: Parameter,
    w_out: Parameter,
    gate: Parameter,
    saved: Option<[Tensor; 6]>,
}

impl ResidualMlp {
    fn new(d: usize, h: usize, key: &InitKey) -> Result<Self> {
        let p = |name: &str, shape: &[usize]| -> Result<Parameter> {
            Ok(Parameter::new(name, key.uniform(name, shape, 0.5)?))
        };
        Ok(ResidualMlp {
            h,
            w_in: p("w_in", &[2 * h, d])?,
            b_in: p("b_in", &[2 * h])?,
            w_out: p("w_out", &[d, h])?,
            gate: p("gate", &[d])?,
            saved: None,
        })
    }
}

/// `p.grad += g` (when `p` trains).
fn accumulate(p: &mut Parameter, g: &Tensor) -> Result<()> {
    match p.grad_for_accumulate()? {
        Some(dst) => ops::add_(dst, g),
        None => Ok(()),
    }
}

impl Module for ResidualMlp {
    fn type_name(&self) -> &str {
        "ResidualMLP"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let u = ops::mm(x, self.w_in.data()?, Transpose::NT)?;
        ops::bias_add_(&u, self.b_in.data()?)?;
        let [a, g]: [Tensor; 2] = ops::split(&u, &[self.h, self.h], -1)?
            .try_into()
            .map_err(|_| Error::InvalidArgument("split into two".into()))?;
        let r = ops::pointwise(Pointwise::Relu, &g)?;
        let v = ops::mul(&a, &r)?;
        let z = ops::mm(&v, self.w_out.data()?, Transpose::NT)?;
        let y = ops::add(x, &ops::mul(&z, self.gate.data()?)?)?;
        let out = ops::sub(&y, &ops::mean_dim(&y, -1, true)?)?;
        if cx.grad_enabled {
            self.saved = Some([x.clone(), a, g, r, v, z]);
        }
        Ok(out)
    }

    fn backward(&mut self, dy: &Tensor, _: &Context) -> Result<Tensor> {
        let [x, a, g, r, v, z] = self.saved.take().ok_or(Error::NoSavedForward {
            module: "ResidualMLP",
        })?;
        let ys = x.shape().to_vec();
        let n = ys[0];
        // out = y - mean(y): dy_y = dy - mean(dy) over the last dimension.
        let (d1, dm) = ops::sub_backward(dy, &ys, &[n, 1])?;
        let dyy = ops::add(&d1, &ops::sum_dim_backward(&dm, &ys, -1, true)?)?;
        // y = x + z * gate
        let (dz, dgate) = ops::mul_backward(&dyy, &z, self.gate.data()?)?;
        accumulate(&mut self.gate, &dgate)?;
        let (dv, dw_out) = ops::mm_backward(&dz, &v, self.w_out.data()?, Transpose::NT)?;
        accumulate(&mut self.w_out, &dw_out)?;
        let (da, dr) = ops::mul_backward(&dv, &a, &r)?;
        let dg = ops::pointwise_backward(Pointwise::Relu, &g, &dr)?;
        let du = ops::split_backward(&[&da, &dg], -1)?;
        if let Some(gb) = self.b_in.grad_for_accumulate()? {
            ops::bias_grad(&du, gb)?;
        }
        let (dx, dw_in) = ops::mm_backward(&du, &x, self.w_in.data()?, Transpose::NT)?;
        accumulate(&mut self.w_in, &dw_in)?;
        ops::add(&dyy, &dx)
    }

    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("w_in", &mut self.w_in)?;
        f("b_in", &mut self.b_in)?;
        f("w_out", &mut self.w_out)?;
        f("gate", &mut self.gate)
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        nn::no_children(f)
    }
}

/// PyTorch's `Sequential(OrderedDict(proj=Linear(6, 8), block1=ResidualMLP(8, 5),
/// act=ReLU(), block2=ResidualMLP(8, 5), head=Linear(8, 3)))`.
fn residual_model(seed: u64) -> Result<Sequential> {
    let k = InitKey::new(seed);
    Sequential::named(vec![
        (
            "proj",
            Box::new(Linear::new(6, 8, true, &k.child("proj"))?) as Box<dyn Module>,
        ),
        (
            "block1",
            Box::new(ResidualMlp::new(8, 5, &k.child("block1"))?),
        ),
        ("act", Box::new(ReLU::new())),
        (
            "block2",
            Box::new(ResidualMlp::new(8, 5, &k.child("block2"))?),
        ),
        ("head", Box::new(Linear::new(8, 3, true, &k.child("head"))?)),
    ])
}

#[test]
fn residual_mlp_loads_pytorch_weights_and_matches_its_output_and_gradients() -> Result<()> {
    let refs = common::module_refs();
    let r = &refs["residual_mlp"];
    let mut m = residual_model(0)?;
    let names: Vec<String> = nn::parameter_shapes(&mut m)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let want: Vec<String> = serde_json::from_value(r["names"].clone()).unwrap();
    assert_eq!(names, want, "named_parameters() names");
    let sd =
        fsdp::checkpoint::load_state_dict_file(&Path::new(REFS).join("residual_mlp.safetensors"))?;
    let skipped = nn::load_state_dict(&mut m, &sd, true)?;
    assert_eq!(skipped, nn::IncompatibleKeys::default());
    let x = Tensor::from_vec(common::json_f32s(&r["x"]), &[4, 6])?;
    let y = m.forward(&x, &Context::train())?;
    common::assert_close(
        "forward",
        &y.to_vec_f32()?,
        &common::json_f32s(&r["y"]),
        1e-6,
        1e-6,
    );
    m.backward(
        &Tensor::from_vec(vec![1.0f32; 12], &[4, 3])?,
        &Context::train(),
    )?;
    let mut grads = Vec::new();
    nn::visit_parameters(&mut m, "", false, &mut |n, p| {
        grads.push((n.to_string(), p.grad().map(|g| g.to_vec_f32()).transpose()?));
        Ok(())
    })?;
    for (n, g) in grads {
        let want = common::json_f32s(&r["grads"][&n]);
        common::assert_close(&format!("grad {n}"), &g.unwrap(), &want, 1e-5, 1e-5);
    }
    // The same weights saved as bf16 load into the f32 parameters, rounded.
    let sd = fsdp::checkpoint::load_state_dict_file(
        &Path::new(REFS).join("residual_mlp_bf16.safetensors"),
    )?;
    assert!(sd.tensors.iter().all(|(_, t)| t.dtype() == DType::BF16));
    nn::load_state_dict(&mut m, &sd, true)?;
    let y = m.forward(&x, &Context::eval())?;
    let want = common::json_f32s(&r["y_bf16"]);
    common::assert_close(
        "forward of bf16 weights",
        &y.to_vec_f32()?,
        &want,
        1e-6,
        1e-6,
    );
    Ok(())
}

/// Parameters after `steps` SGD steps on the same batch: unsharded, or under FSDP with
/// each ResidualMLP its own unit at `world` thread ranks (every rank the same batch, so
/// the averaged gradient is the unsharded one).
fn train(world: Option<usize>, steps: usize) -> Result<Vec<(String, Vec<f32>)>> {
    let step = |m: &mut dyn Module, i: usize| -> Result<()> {
        let x = randt(100 + i as u64, &[5, 6])?;
        let t = randt(200 + i as u64, &[5, 3])?;
        let y = m.forward(&x, &Context::train())?;
        let (_, g) = nn::loss::mse_loss(&y, &t)?;
        m.backward(&g, &Context::train())?;
        Ok(())
    };
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    };
    match world {
        None => {
            let mut m = residual_model(3)?;
            let mut opt = SGD::new(cfg);
            for i in 0..steps {
                nn::zero_grad(&mut m);
                step(&mut m, i)?;
                opt.step(&fsdp::optim::parameters(&mut m))?;
            }
            Ok(nn::state_dict(&mut m)?
                .tensors
                .into_iter()
                .map(|(n, t)| (n, t.to_vec_f32().unwrap()))
                .collect())
        }
        Some(w) => {
            let mut outs = launch(&LaunchOptions::new(w), |pg| {
                let cfg_fsdp = FsdpConfig {
                    auto_wrap_policy: Some(transformer_auto_wrap_policy(["ResidualMLP"])),
                    ..Default::default()
                };
                let mut m =
                    FullyShardedDataParallel::new(Box::new(residual_model(3)?), pg, cfg_fsdp)?;
                let mut opt = SGD::new(cfg);
                for i in 0..steps {
                    m.zero_grad();
                    step(&mut m, i)?;
                    opt.step(&m.optimizer_params())?;
                }
                // The state dict of the wrapped model (a collective on every rank).
                let sd = nn::state_dict(&mut m)?;
                sd.tensors
                    .into_iter()
                    .map(|(n, t)| Ok((n, t.to_vec_f32()?)))
                    .collect::<Result<Vec<_>>>()
            })?;
            Ok(outs.remove(0))
        }
    }
}

#[test]
fn residual_mlp_trains_under_fsdp_as_unsharded() -> Result<()> {
    let want = train(None, 3)?;
    let start = {
        let mut m = residual_model(3)?;
        nn::state_dict(&mut m)?.tensors
    };
    for w in [1, 2] {
        let got = train(Some(w), 3)?;
        assert_eq!(got.len(), want.len());
        for ((gn, gv), (wn, wv)) in got.iter().zip(&want) {
            assert_eq!(gn, wn);
            common::assert_close(&format!("world {w}: {gn}"), gv, wv, 1e-6, 1e-6);
        }
    }
    // It trained: every parameter moved.
    for ((n, t), (_, v)) in start.iter().zip(&want) {
        assert_ne!(&t.to_vec_f32()?, v, "{n} never changed");
    }
    Ok(())
}
