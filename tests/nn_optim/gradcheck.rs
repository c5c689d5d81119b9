//! Finite-difference gradient checks for every layer in `fsdp::nn` and the losses.
//!
//! For a module `m`, input `x` and a fixed random projection `r` of the output shape,
//! `L = sum(m.forward(x) * r)` (in f64 from the f32 output). The analytic gradients come
//! from `forward(train)` + `backward(r)`; the numeric ones from central differences of `L`.

use fsdp::error::Error;
use fsdp::nn::{
    self, loss, Block, CausalSelfAttention, Context, Embedding, GptConfig, InitKey, LayerNorm,
    Linear, Module, Sequential, GELU, GPT, MLP,
};
use fsdp::tensor::{DType, Tensor};
use fsdp::Result;

/// Finite-difference step (f32 arithmetic: large enough to beat rounding, small enough
/// for the truncation error to stay below the tolerance).
const EPS: f32 = 1e-2;
/// Pass when `|a - n| <= RTOL * max(|a|, |n|) + ATOL`.
const RTOL: f64 = 1e-2;
const ATOL: f64 = 2e-3;
/// Tensors up to this size are checked element by element; larger ones on 50 elements.
const FULL_CHECK: usize = 100;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` deterministic values uniform in `[-1, 1)`.
fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let u = (splitmix64(seed.wrapping_mul(0x1234_5678_9ABC_DEF1) ^ splitmix64(i)) >> 40)
                as f32
                / (1u64 << 24) as f32;
            2.0 * u - 1.0
        })
        .collect()
}

fn randt(seed: u64, shape: &[usize], scale: f32) -> Result<Tensor> {
    let n = shape.iter().product();
    Tensor::from_vec(rand_vec(seed, n).iter().map(|v| v * scale).collect(), shape)
}

/// `x` with every value pushed away from zero: `|x| in [0.2, 1.2)` (for ReLU's kink).
fn away_from_zero(seed: u64, shape: &[usize]) -> Result<Tensor> {
    let n = shape.iter().product();
    let v = rand_vec(seed, n)
        .iter()
        .map(|&v| v + 0.2 * v.signum())
        .collect();
    Tensor::from_vec(v, shape)
}

fn ids(v: &[i32], shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), shape)
}

/// Indices of a tensor of `n` elements to check: all, or 50 spread deterministically.
fn sample(n: usize, seed: u64) -> Vec<usize> {
    if n <= FULL_CHECK {
        return (0..n).collect();
    }
    let step = n / 50;
    (0..50u64)
        .map(|i| i as usize * step + (splitmix64(seed ^ i) % step as u64) as usize)
        .collect()
}

/// Sets every parameter of `m` to deterministic values uniform in `[-scale, scale)`, so
/// the checks do not rest on special init values (LayerNorm's ones/zeros, zero biases).
fn randomize(m: &mut dyn Module, seed: u64, scale: f32) {
    let mut k = 0;
    nn::visit_parameters(m, "", false, &mut |_, p| {
        k += 1;
        let mut d = p.data().unwrap().f32_mut().unwrap();
        let n = d.len();
        for (dst, v) in d.iter_mut().zip(rand_vec(seed + k, n)) {
            *dst = v * scale;
        }
        Ok(())
    })
    .unwrap();
}

/// Compares `analytic` gradients of each named tensor with central differences of `loss`,
/// perturbing the tensor in place (and restoring it). Panics listing the mismatches.
fn fd_check(
    what: &str,
    targets: &[(String, Tensor, Vec<f32>)],
    loss: &mut dyn FnMut() -> Result<f64>,
) -> Result<()> {
    let (mut bad, mut max_err, mut checked) = (Vec::new(), 0.0f64, 0);
    for (ti, (name, t, analytic)) in targets.iter().enumerate() {
        assert_eq!(analytic.len(), t.numel(), "{what}: gradient size of {name}");
        for i in sample(t.numel(), ti as u64) {
            let orig = t.f32()?[i];
            t.f32_mut()?[i] = orig + EPS;
            let lp = loss()?;
            t.f32_mut()?[i] = orig - EPS;
            let lm = loss()?;
            t.f32_mut()?[i] = orig;
            let numeric = (lp - lm) / (2.0 * EPS as f64);
            let a = analytic[i] as f64;
            let err = (a - numeric).abs();
            let tol = RTOL * a.abs().max(numeric.abs()) + ATOL;
            max_err = max_err.max(err);
            checked += 1;
            if err > tol || !err.is_finite() {
                bad.push(format!(
                    "  {name}[{i}]: analytic {a:.6} numeric {numeric:.6} err {err:.2e} tol {tol:.2e}"
                ));
            }
        }
    }
    if !bad.is_empty() {
        let first = bad.iter().take(10).cloned().collect::<Vec<_>>().join("\n");
        panic!(
            "{what}: {} of {checked} gradient elements differ (max err {max_err:.3e}, \
             tol {RTOL} * max(|a|, |n|) + {ATOL}):\n{first}",
            bad.len()
        );
    }
    Ok(())
}

fn dot(y: &Tensor, r: &Tensor) -> Result<f64> {
    assert_eq!(y.shape(), r.shape());
    Ok(y.f32()?
        .iter()
        .zip(r.f32()?.iter())
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum())
}

/// Parameter gradients by fully qualified name (panics when a trainable one has none).
fn param_grads(m: &mut dyn Module) -> Vec<(String, Tensor, Vec<f32>)> {
    let mut out = Vec::new();
    nn::visit_parameters(m, "", false, &mut |n, p| {
        let g = p.grad().unwrap_or_else(|| panic!("no gradient for {n}"));
        assert_eq!(g.shape(), p.shape(), "gradient shape of {n}");
        out.push((
            n.to_string(),
            p.data().unwrap().clone(),
            g.to_vec_f32().unwrap(),
        ));
        Ok(())
    })
    .unwrap();
    out
}

/// Gradient check of `m` at input `x` (f32: d/dx is checked too; i32 ids: backward must
/// return an empty tensor). Also checks that a second backward accumulates (`+=`).
fn check_module(what: &str, m: &mut dyn Module, x: &Tensor) -> Result<()> {
    let y = m.forward(x, &Context::eval())?;
    let r = randt(0xC0FFEE, y.shape(), 1.0)?;
    nn::visit_parameters(m, "", false, &mut |_, p| {
        p.set_grad(None);
        Ok(())
    })
    .unwrap();
    let y_train = m.forward(x, &Context::train())?;
    assert_eq!(
        &*y_train.f32()?,
        &*y.f32()?,
        "{what}: forward differs in train and eval"
    );
    let dx = m.backward(&r, &Context::train())?;
    let mut targets = param_grads(m);
    if x.dtype() == DType::F32 {
        assert_eq!(dx.shape(), x.shape(), "{what}: shape of d input");
        targets.insert(0, ("input".to_string(), x.clone(), dx.to_vec_f32()?));
    } else {
        assert_eq!(dx.numel(), 0, "{what}: d ids must be empty");
    }
    // A second forward/backward adds the same gradients again.
    m.forward(x, &Context::train())?;
    m.backward(&r, &Context::train())?;
    let again = param_grads(m);
    let first = &targets[targets.len() - again.len()..];
    for ((name, _, twice), (_, _, once)) in again.iter().zip(first) {
        for (a, b) in once.iter().zip(twice) {
            let ok = (2.0 * a - b).abs() <= 1e-5 * (1.0 + b.abs());
            assert!(ok, "{what}: {name} does not accumulate: {a}, then {b}");
        }
    }
    fd_check(what, &targets, &mut || {
        dot(&m.forward(x, &Context::eval())?, &r)
    })
}

fn check_loss(what: &str, x: &Tensor, f: &dyn Fn(&Tensor) -> Result<(f32, Tensor)>) -> Result<()> {
    let (_, g) = f(x)?;
    assert_eq!(g.shape(), x.shape(), "{what}: gradient shape");
    let targets = [("input".to_string(), x.clone(), g.to_vec_f32()?)];
    fd_check(what, &targets, &mut || Ok(f(x)?.0 as f64))
}

fn key() -> InitKey {
    InitKey::new(17)
}

#[test]
fn linear_with_bias() -> Result<()> {
    let mut m = Linear::new(5, 4, true, &key())?;
    check_module("Linear(5, 4)", &mut m, &randt(1, &[2, 3, 5], 1.0)?)
}

#[test]
fn linear_without_bias() -> Result<()> {
    let mut m = Linear::new(6, 3, false, &key())?;
    check_module("Linear(6, 3, bias=False)", &mut m, &randt(2, &[4, 6], 1.0)?)
}

#[test]
fn linear_hand_computed() -> Result<()> {
    let mut m = Linear::new(2, 2, true, &key())?;
    m.weight
        .data()?
        .f32_mut()?
        .copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
    m.bias
        .as_ref()
        .unwrap()
        .data()?
        .f32_mut()?
        .copy_from_slice(&[0.5, -1.0]);
    let x = Tensor::from_vec(vec![1.0f32, 1.0, 2.0, -1.0], &[2, 2])?;
    // y = x W^T + b
    let y = m.forward(&x, &Context::train())?;
    assert_eq!(&*y.f32()?, &[3.5, 6.0, 0.5, 1.0]);
    let dy = Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 1.0], &[2, 2])?;
    let dx = m.backward(&dy, &Context::train())?;
    assert_eq!(&*dx.f32()?, &[1.0, 2.0, 3.0, 4.0]); // dy W
    assert_eq!(&*m.weight.grad().unwrap().f32()?, &[1.0, 1.0, 2.0, -1.0]); // dy^T x
    assert_eq!(
        &*m.bias.as_ref().unwrap().grad().unwrap().f32()?,
        &[1.0, 1.0]
    );
    Ok(())
}

#[test]
fn relu() -> Result<()> {
    check_module("ReLU", &mut nn::ReLU::new(), &away_from_zero(3, &[3, 7])?)
}

#[test]
fn gelu() -> Result<()> {
    check_module("GELU", &mut GELU::new(), &randt(4, &[3, 7], 3.0)?)
}

#[test]
fn layernorm() -> Result<()> {
    let mut m = LayerNorm::new(6)?;
    randomize(&mut m, 5, 1.0);
    check_module("LayerNorm(6)", &mut m, &randt(6, &[2, 3, 6], 1.0)?)
}

#[test]
fn embedding() -> Result<()> {
    // Rows 3 and 4 are unused (zero gradient); 0, 2 and 5 repeat (gradients add up).
    let mut m = Embedding::new(6, 3, 1.0, &key())?;
    check_module(
        "Embedding(6, 3)",
        &mut m,
        &ids(&[0, 2, 2, 5, 1, 2, 0, 5], &[2, 4])?,
    )
}

#[test]
fn causal_self_attention() -> Result<()> {
    let mut m = CausalSelfAttention::new(8, 2, &key())?;
    randomize(&mut m, 7, 0.5);
    check_module(
        "CausalSelfAttention(8, 2)",
        &mut m,
        &randt(8, &[2, 4, 8], 1.0)?,
    )
}

#[test]
fn mlp() -> Result<()> {
    let mut m = MLP::new(6, &key())?;
    randomize(&mut m, 9, 0.5);
    check_module("MLP(6)", &mut m, &randt(10, &[2, 3, 6], 1.0)?)
}

#[test]
fn block() -> Result<()> {
    let mut m = Block::new(8, 2, &key())?;
    randomize(&mut m, 11, 0.5);
    check_module("Block(8, 2)", &mut m, &randt(12, &[2, 4, 8], 1.0)?)
}

#[test]
fn sequential_linear_relu_linear() -> Result<()> {
    let mut m = Sequential::new(vec![
        Box::new(Linear::new(5, 7, true, &key().child("0"))?),
        Box::new(nn::ReLU::new()),
        Box::new(Linear::new(7, 3, true, &key().child("2"))?),
    ]);
    randomize(&mut m, 13, 1.0);
    check_module(
        "Sequential(Linear, ReLU, Linear)",
        &mut m,
        &randt(14, &[4, 5], 1.0)?,
    )
}

#[test]
fn gpt_tiny() -> Result<()> {
    let config = GptConfig {
        vocab_size: 11,
        block_size: 5,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
    };
    let mut m = GPT::new(config, 3)?;
    randomize(&mut m, 15, 0.5);
    // wte.weight (11 x 8 = 88 elements) is checked element by element: it is both the
    // token embedding and the output projection. Ids 4, 6, 8 and 10 appear only through
    // the output projection; 1 and 3 repeat.
    let x = ids(&[1, 3, 3, 7, 0, 2, 9, 3, 5, 1], &[2, 5])?;
    check_module("GPT(tiny)", &mut m, &x)?;
    // T < block_size: wpe rows past T get no gradient.
    check_module("GPT(tiny, T=3)", &mut m, &ids(&[4, 0, 10], &[1, 3])?)
}

#[test]
fn cross_entropy() -> Result<()> {
    let targets = ids(&[0, 4, 2, 2, 1, 3], &[2, 3])?;
    let logits = randt(16, &[2, 3, 5], 2.0)?;
    check_loss("cross_entropy", &logits, &|x| {
        loss::cross_entropy(x, &targets)
    })
}

#[test]
fn mse_loss() -> Result<()> {
    let target = randt(17, &[3, 4], 1.0)?;
    check_loss("mse_loss", &randt(18, &[3, 4], 1.0)?, &|x| {
        loss::mse_loss(x, &target)
    })
}

#[test]
fn sum_loss() -> Result<()> {
    check_loss("sum_loss", &randt(19, &[2, 3, 4], 1.0)?, &loss::sum_loss)
}

/// One of each module, with an input.
fn all_modules() -> Result<Vec<(Box<dyn Module>, Tensor)>> {
    let config = GptConfig {
        vocab_size: 11,
        block_size: 5,
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
    };
    let x = || randt(1, &[2, 4], 1.0);
    let x3 = || randt(1, &[1, 2, 8], 1.0);
    Ok(vec![
        (Box::new(Linear::new(4, 4, true, &key())?), x()?),
        (Box::new(nn::ReLU::new()), x()?),
        (Box::new(GELU::new()), x()?),
        (Box::new(LayerNorm::new(4)?), x()?),
        (
            Box::new(Embedding::new(5, 4, 1.0, &key())?),
            ids(&[1, 2], &[2])?,
        ),
        (Box::new(CausalSelfAttention::new(8, 2, &key())?), x3()?),
        (Box::new(MLP::new(4, &key())?), x()?),
        (Box::new(Block::new(8, 2, &key())?), x3()?),
        (Box::new(Sequential::new(vec![Box::new(GELU::new())])), x()?),
        (Box::new(GPT::new(config, 0)?), ids(&[1, 2], &[1, 2])?),
    ])
}

#[test]
fn backward_without_forward_is_an_error() -> Result<()> {
    let fresh = all_modules()?;
    for ((mut m, x), (mut fresh, _)) in all_modules()?.into_iter().zip(fresh) {
        let name = m.type_name().to_string();
        let dy = randt(2, m.forward(&x, &Context::eval())?.shape(), 1.0)?;
        let no_saved = |r: Result<Tensor>| matches!(r, Err(Error::NoSavedForward { .. }));
        let err = fresh.backward(&dy, &Context::train());
        assert!(no_saved(err), "{name} without forward");
        let err = m.backward(&dy, &Context::train());
        assert!(
            no_saved(err),
            "{name} after forward(eval), which saves nothing"
        );
        m.forward(&x, &Context::train())?;
        m.backward(&dy, &Context::train())?;
        let err = m.backward(&dy, &Context::train());
        assert!(no_saved(err), "{name}: second backward after one forward");
    }
    Ok(())
}
