//! The two candle-nn models the tests train (an MLP and a small GPT-style transformer),
//! their deterministic data, and the plain candle training loop they are compared with.

use candle::{DType, Device, Module, Shape, Tensor, Var, D};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{embedding, layer_norm, linear, linear_no_bias, Embedding, LayerNorm, Linear};
use candle_nn::{Init, Optimizer, VarBuilder, VarMap};
use std::collections::BTreeMap;

/// Element `i` of the deterministic stream `seed`, in [-1, 1].
pub fn value(seed: u64, i: u64) -> f32 {
    let mut h = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((i + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
    h ^= h >> 31;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 29;
    (h % 2001) as f32 / 1000.0 - 1.0
}

/// MLP: `x (n, 7) -> Linear 16 -> ReLU -> Linear 16 -> ReLU -> Linear 3`, vars
/// `layers.{0,1,2}.{weight,bias}`.
pub struct Mlp {
    layers: Vec<Linear>,
}

/// Sizes of the MLP's layers.
pub const MLP_DIMS: [usize; 4] = [7, 16, 16, 3];

pub fn mlp(vb: VarBuilder) -> candle::Result<Mlp> {
    let layers = (0..3)
        .map(|i| linear(MLP_DIMS[i], MLP_DIMS[i + 1], vb.pp("layers").pp(i)))
        .collect::<candle::Result<_>>()?;
    Ok(Mlp { layers })
}

impl Mlp {
    pub fn forward(&self, x: &Tensor) -> candle::Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Rows of one step's global batch.
pub const ROWS: usize = 8;

/// Rows `lo..hi` of step `s`'s MLP batch: inputs `(n, 7)` and targets `(n, 3)`.
pub fn mlp_batch(s: usize, lo: usize, hi: usize) -> (Tensor, Tensor) {
    let (i, o) = (MLP_DIMS[0], MLP_DIMS[3]);
    let x: Vec<f32> = (lo * i..hi * i)
        .map(|k| value(100 + s as u64, k as u64))
        .collect();
    // A function of x the MLP can learn: t_j = tanh(sum_k x_k a_jk), a fixed.
    let t: Vec<f32> = x
        .chunks(i)
        .flat_map(|r| {
            (0..o).map(move |j| {
                let z: f32 = (0..i).map(|k| r[k] * value(7, (j * i + k) as u64)).sum();
                z.tanh()
            })
        })
        .collect();
    let n = hi - lo;
    (
        Tensor::from_vec(x, (n, i), &Device::Cpu).unwrap(),
        Tensor::from_vec(t, (n, o), &Device::Cpu).unwrap(),
    )
}

pub fn mlp_loss(m: &Mlp, s: usize, lo: usize, hi: usize) -> candle::Result<Tensor> {
    let (x, t) = mlp_batch(s, lo, hi);
    candle_nn::loss::mse(&m.forward(&x)?, &t)
}

/// Transformer sizes: vocabulary (a prime), width, heads, sequence length, blocks.
pub const VOCAB: usize = 17;
pub const WIDTH: usize = 16;
pub const HEADS: usize = 2;
pub const SEQ: usize = 6;
pub const BLOCKS: usize = 2;

struct Block {
    ln1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    out: Linear,
}

/// GPT-2 style: token and position embeddings, pre-LayerNorm blocks (causal attention,
/// GELU MLP), a final LayerNorm and a head tied to the token embedding. q, k, v have no
/// bias: a key bias gets a gradient that is zero in exact arithmetic (softmax ignores a
/// shift per query), so its rounding noise would steer Adam differently in every run.
pub struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
}

pub fn gpt(vb: VarBuilder) -> candle::Result<Gpt> {
    let d = WIDTH;
    let mut blocks = Vec::new();
    for i in 0..BLOCKS {
        let b = vb.pp("blocks").pp(i);
        blocks.push(Block {
            ln1: layer_norm(d, 1e-5, b.pp("ln1"))?,
            q: linear_no_bias(d, d, b.pp("attn.q"))?,
            k: linear_no_bias(d, d, b.pp("attn.k"))?,
            v: linear_no_bias(d, d, b.pp("attn.v"))?,
            proj: linear(d, d, b.pp("attn.proj"))?,
            ln2: layer_norm(d, 1e-5, b.pp("ln2"))?,
            fc: linear(d, 4 * d, b.pp("mlp.fc"))?,
            out: linear(4 * d, d, b.pp("mlp.out"))?,
        });
    }
    Ok(Gpt {
        wte: embedding(VOCAB, d, vb.pp("wte"))?,
        wpe: embedding(SEQ, d, vb.pp("wpe"))?,
        blocks,
        ln_f: layer_norm(d, 1e-5, vb.pp("ln_f"))?,
    })
}

/// candle_nn's `LayerNorm::forward` takes a fused kernel without a backward for
/// contiguous inputs; training goes through the composed ops.
fn ln(l: &LayerNorm, x: &Tensor) -> candle::Result<Tensor> {
    let bias = l
        .bias()
        .ok_or_else(|| candle::Error::Msg("layer norm without bias".into()))?;
    candle_nn::ops::layer_norm_slow(x, l.weight(), bias, l.eps() as f32)
}

impl Gpt {
    /// Logits `(b, t, VOCAB)` of token ids `(b, t)`.
    pub fn forward(&self, ids: &Tensor) -> candle::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let pos = self.wpe.embeddings().narrow(0, 0, t)?;
        let mut x = self.wte.forward(ids)?.broadcast_add(&pos)?;
        let hd = WIDTH / HEADS;
        let mask: Vec<u8> = (0..t * t).map(|k| u8::from(k % t > k / t)).collect();
        let mask = Tensor::from_vec(mask, (t, t), ids.device())?.broadcast_as((b, HEADS, t, t))?;
        let neg = Tensor::new(f32::NEG_INFINITY, ids.device())?.broadcast_as((b, HEADS, t, t))?;
        for blk in &self.blocks {
            let h = ln(&blk.ln1, &x)?;
            let heads = |l: &Linear| -> candle::Result<Tensor> {
                l.forward(&h)?
                    .reshape((b, t, HEADS, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let (q, k, v) = (heads(&blk.q)?, heads(&blk.k)?, heads(&blk.v)?);
            let att = (q.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?;
            let att = mask.where_cond(&neg, &att)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let y = att
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b, t, WIDTH))?;
            x = (x + blk.proj.forward(&y)?)?;
            let h = ln(&blk.ln2, &x)?;
            x = (x + blk.out.forward(&blk.fc.forward(&h)?.gelu()?)?)?;
        }
        let x = ln(&self.ln_f, &x)?;
        // The head is the token embedding, transposed (weight tying), scaled by
        // 1/sqrt(WIDTH) so that the N(0, 1) embeddings give logits of about unit size.
        x.broadcast_matmul(&self.wte.embeddings().t()?)? / (WIDTH as f64).sqrt()
    }
}

/// Sequences `lo..hi` of step `s`'s batch: ids `(n, SEQ)` and next-token targets. Each
/// sequence counts up modulo VOCAB from a pseudo-random start with a stride of 1, 2 or 3:
/// learnable from the context.
pub fn gpt_batch(s: usize, lo: usize, hi: usize) -> (Tensor, Tensor) {
    let mut ids = Vec::new();
    for q in lo..hi {
        let r = |k: u64| (value(300 + s as u64, 2 * q as u64 + k) * 1000.0).abs() as usize;
        let (start, stride) = (r(0) % VOCAB, 1 + r(1) % 3);
        ids.extend((0..=SEQ).map(|t| ((start + t * stride) % VOCAB) as u32));
    }
    let n = hi - lo;
    let all = Tensor::from_vec(ids, (n, SEQ + 1), &Device::Cpu).unwrap();
    (
        all.narrow(1, 0, SEQ).unwrap(),
        all.narrow(1, 1, SEQ).unwrap(),
    )
}

pub fn gpt_loss(m: &Gpt, s: usize, lo: usize, hi: usize) -> candle::Result<Tensor> {
    let (ids, t) = gpt_batch(s, lo, hi);
    let logits = m.forward(&ids)?;
    let n = (hi - lo) * SEQ;
    candle_nn::loss::cross_entropy(&logits.reshape((n, VOCAB))?, &t.reshape(n)?)
}

/// A `VarBuilder` backend that creates each var once, in a `VarMap`, with deterministic
/// values scaled like candle's initializer for it (the `Init` hint): constants as they are,
/// the random ones as a fixed pseudo-random stream of the same mean and spread. candle's
/// CPU generator cannot be seeded, and AdamW amplifies rounding differences in elements
/// whose gradient nearly cancels: with candle's random values, one run in a few put a
/// transformer weight 3e-6 away between two world sizes. Fixed values make every run
/// the same.
struct Fixed(VarMap);

impl SimpleBackend for Fixed {
    fn get(&self, s: Shape, name: &str, h: Init, _: DType, dev: &Device) -> candle::Result<Tensor> {
        let mut data = self.0.data().lock().unwrap();
        if let Some(v) = data.get(name) {
            return Ok(v.as_tensor().clone());
        }
        let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let fan_in = s.dims().iter().skip(1).product::<usize>().max(1) as f64;
        let u = |i: usize| f64::from(value(seed, i as u64));
        let values: Vec<f32> = (0..s.elem_count())
            .map(|i| match h {
                Init::Const(c) => c,
                // Uniform with the same mean and standard deviation.
                Init::Randn { mean, stdev } => mean + stdev * 3f64.sqrt() * u(i),
                Init::Uniform { lo, up } => lo + (up - lo) * (u(i) + 1.0) / 2.0,
                // Kaiming for ReLU (candle_nn::linear's weights): std sqrt(2 / fan_in).
                Init::Kaiming { .. } => (6.0 / fan_in).sqrt() * u(i),
            } as f32)
            .collect();
        let var = Var::from_vec(values, s, dev)?;
        let t = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle::Result<Tensor> {
        candle::bail!("{name}: get_unchecked has no shape to create a var with")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.data().lock().unwrap().contains_key(name)
    }
}

/// A model's initial values: the vars its builder asks for, with [`Fixed`] values.
pub fn init<M>(build: fn(VarBuilder) -> candle::Result<M>) -> VarMap {
    let vm = VarMap::new();
    let vb = VarBuilder::from_backend(Box::new(Fixed(vm.clone())), DType::F32, Device::Cpu);
    build(vb).unwrap();
    vm
}

/// A deep copy of `vm` (new vars with the same values).
pub fn copy(vm: &VarMap) -> VarMap {
    let out = VarMap::new();
    {
        let mut d = out.data().lock().unwrap();
        for (n, v) in vm.data().lock().unwrap().iter() {
            d.insert(
                n.clone(),
                candle::Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap(),
            );
        }
    }
    out
}

/// Every var's values, by name.
pub fn values(vm: &VarMap) -> BTreeMap<String, Vec<f32>> {
    vm.data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect()
}

/// The optimizers compared: candle_nn's on the reference, fsdp's on the shards.
#[derive(Debug, Clone, Copy)]
pub enum Opt {
    /// Plain SGD (candle_nn's has no momentum): `p -= lr g`.
    Sgd(f32),
    /// AdamW with lr, (0.9, 0.999), eps 1e-8, weight decay 0.01 (both crates' defaults).
    AdamW(f32),
}

impl Opt {
    pub fn fsdp(self) -> Box<dyn fsdp::optim::Optimizer> {
        use fsdp::optim::{AdamConfig, AdamW, SgdConfig, SGD};
        match self {
            Opt::Sgd(lr) => Box::new(SGD::new(SgdConfig {
                lr,
                ..Default::default()
            })),
            Opt::AdamW(lr) => Box::new(AdamW::new(AdamConfig {
                lr,
                ..AdamConfig::adamw()
            })),
        }
    }
}

/// What a training run gives: the loss of each step (for a sharded run the mean of the
/// ranks') and the final values by var name.
pub type Trained = (Vec<f32>, BTreeMap<String, Vec<f32>>);

/// A training run: the model's builder, its loss on rows `lo..hi` of step `s`'s batch
/// (`loss(model, s, lo, hi)`), the initial values, the optimizer and the step count.
pub struct Run<'a, M> {
    pub build: fn(VarBuilder) -> candle::Result<M>,
    pub loss: fn(&M, usize, usize, usize) -> candle::Result<Tensor>,
    pub init: &'a VarMap,
    pub opt: Opt,
    pub steps: usize,
}

/// The MLP trained with SGD (lr 0.1) for `steps` steps from `init`.
pub fn mlp_sgd(init: &VarMap, steps: usize) -> Run<'_, Mlp> {
    Run {
        build: mlp,
        loss: mlp_loss,
        init,
        opt: Opt::Sgd(0.1),
        steps,
    }
}

/// The plain candle loop on one process: `run.steps` steps on the whole global batch from a
/// copy of `run.init`. Returns the losses and the final values.
pub fn reference<M>(run: &Run<M>) -> Trained {
    reference_skipping(run, None)
}

/// [`reference`] that leaves out step `skip` (its batch is never seen; the later steps
/// keep their own batches). The losses are those of the steps run.
pub fn reference_skipping<M>(run: &Run<M>, skip: Option<usize>) -> Trained {
    let (build, loss, opt) = (run.build, run.loss, run.opt);
    let vm = copy(run.init);
    let model = build(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
    let mut losses = Vec::new();
    // candle_nn's `backward_step`: backward, then the update.
    type Step = Box<dyn FnMut(&Tensor) -> candle::Result<()>>;
    let mut o: Step = match opt {
        Opt::Sgd(lr) => {
            let mut sgd = candle_nn::SGD::new(vm.all_vars(), lr as f64).unwrap();
            Box::new(move |l| sgd.backward_step(l))
        }
        Opt::AdamW(lr) => {
            let p = candle_nn::ParamsAdamW {
                lr: lr as f64,
                ..Default::default()
            };
            let mut adamw = candle_nn::AdamW::new(vm.all_vars(), p).unwrap();
            Box::new(move |l| adamw.backward_step(l))
        }
    };
    for s in (0..run.steps).filter(|&s| Some(s) != skip) {
        let l = loss(&model, s, 0, ROWS).unwrap();
        losses.push(l.to_scalar::<f32>().unwrap());
        o(&l).unwrap();
    }
    (losses, values(&vm))
}

/// `|got - want| <= tol * max(1, |want|)` for every element (absolute below 1, relative
/// above: an f32 of magnitude 4 has a spacing of 4.8e-7); prints the worst pair and how
/// much of the tolerance it used on failure.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut worst, mut at) = (0.0f32, 0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let used = (g - w).abs() / (tol * w.abs().max(1.0));
        // A NaN counts as the worst.
        if used > worst || used.is_nan() {
            (worst, at) = (used, i);
        }
    }
    assert!(
        worst <= 1.0,
        "{what}: element {at} of {}: got {} want {} (|diff| {:e}, {worst:.2} of the tolerance {tol:e} x max(1, |want|))",
        got.len(),
        got[at],
        want[at],
        (got[at] - want[at]).abs()
    );
}
