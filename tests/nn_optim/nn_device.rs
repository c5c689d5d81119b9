//! Every nn layer, the losses, a whole GPT training step and `module_to_device` on every
//! device (see tests/common/device.rs): a model moved to the device must compute what the
//! same model computes on the CPU (bitwise on the CPU, to f32 rounding on CUDA), keep its
//! activations and gradients on the device, and the CPU results must match independent
//! references (naive f64 loops).

use crate::common;
use crate::device;
use crate::device_test;

use common::values;
use device::{check, ids_on, tensor_on, REL};
use fsdp::backend::Device;
use fsdp::nn::{
    self, loss, module_to_device, Block, CausalSelfAttention, Context, Embedding, GptConfig,
    InitKey, LayerNorm, Linear, Module, ReLU, Sequential, GELU, GPT,
};
use fsdp::optim::{AdamConfig, AdamW, Optimizer};
use fsdp::tensor::Tensor;
use fsdp::{Error, Result};

/// `(name, value)` of every parameter below `m`.
fn named_params(m: &mut dyn Module) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    nn::visit_parameters(m, "", false, &mut |n, p| {
        out.push((n.to_string(), p.data().unwrap().clone()));
        Ok(())
    })
    .unwrap();
    out
}

/// `(name, grad)` of every parameter below `m` that has one.
fn named_grads(m: &mut dyn Module) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    nn::visit_parameters(m, "", false, &mut |n, p| {
        out.extend(p.grad().map(|g| (n.to_string(), g.clone())));
        Ok(())
    })
    .unwrap();
    out
}

fn param(m: &mut dyn Module, name: &str) -> Vec<f64> {
    let (_, t) = named_params(m)
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap();
    t.to_vec_f32().unwrap().iter().map(|&v| v as f64).collect()
}

/// What one forward + backward gave on the CPU.
struct CpuRun {
    model: Box<dyn Module>,
    y: Tensor,
    dx: Tensor,
}

/// Builds `make()` twice, moves one copy to `dev`, runs forward(x) and backward(dy) on
/// both (dy: fixed values of the output's shape) and checks outputs, input gradients and
/// every parameter gradient (which must live on `dev`). Returns the CPU run.
fn compare_layer(
    what: &str,
    dev: Device,
    make: &dyn Fn() -> Box<dyn Module>,
    x: &Tensor,
    rel: f32,
) -> Result<CpuRun> {
    let cx = Context::train();
    let mut cpu = make();
    let mut on_dev = make();
    module_to_device(on_dev.as_mut(), dev)?;
    let y = cpu.forward(x, &cx)?;
    let yd = on_dev.forward(&x.to_device(dev)?, &cx)?;
    check(&format!("{what} y"), dev, &yd, &y, rel);
    let dy = Tensor::from_vec(values(77, y.numel()), y.shape())?;
    let dx = cpu.backward(&dy, &cx)?;
    let dxd = on_dev.backward(&dy.to_device(dev)?, &cx)?;
    check(&format!("{what} dx"), dev, &dxd, &dx, rel);
    let (gc, gd) = (named_grads(cpu.as_mut()), named_grads(on_dev.as_mut()));
    assert_eq!(gc.len(), gd.len(), "{what}: gradients of other parameters");
    for ((n, g), (nd, gdv)) in gc.iter().zip(&gd) {
        assert_eq!(n, nd);
        check(&format!("{what} grad {n}"), dev, gdv, g, rel);
    }
    Ok(CpuRun { model: cpu, y, dx })
}

fn assert_f64(what: &str, got: &Tensor, want: &[f64], atol: f64) {
    let g = got.to_vec_f32().unwrap();
    assert_eq!(g.len(), want.len(), "{what}: lengths");
    for (i, (&a, &b)) in g.iter().zip(want).enumerate() {
        assert!(
            (a as f64 - b).abs() <= atol * (1.0 + b.abs()),
            "{what}[{i}]: {a} vs {b}"
        );
    }
}

device_test!(linear_matches_the_cpu, |dev| {
    for (lead, i, o, bias) in [
        (vec![1usize], 1usize, 1usize, true),
        (vec![2, 3], 7, 13, true),
        (vec![11], 13, 5, false),
    ] {
        let rows: usize = lead.iter().product();
        let mut shape = lead.clone();
        shape.push(i);
        let x = Tensor::from_vec(values(1, rows * i), &shape)?;
        let make =
            || Box::new(Linear::new(i, o, bias, &InitKey::new(3)).unwrap()) as Box<dyn Module>;
        let mut r = compare_layer(&format!("Linear({i}, {o})"), dev, &make, &x, REL)?;
        // f64 reference: y = x W^T + b, dx = dy W.
        let w = param(r.model.as_mut(), "weight");
        let b = if bias {
            param(r.model.as_mut(), "bias")
        } else {
            vec![0.0; o]
        };
        let (xv, dy) = (x.to_vec_f32()?, values(77, rows * o));
        let mut y = vec![0.0f64; rows * o];
        let mut dx = vec![0.0f64; rows * i];
        for r_ in 0..rows {
            for j in 0..o {
                y[r_ * o + j] = b[j]
                    + (0..i)
                        .map(|p| xv[r_ * i + p] as f64 * w[j * i + p])
                        .sum::<f64>();
                for p in 0..i {
                    dx[r_ * i + p] += dy[r_ * o + j] as f64 * w[j * i + p];
                }
            }
        }
        assert_f64("Linear y (f64 reference)", &r.y, &y, 1e-5);
        assert_f64("Linear dx (f64 reference)", &r.dx, &dx, 1e-5);
    }
    Ok(())
});

device_test!(activations_match_the_cpu, |dev| {
    let x = Tensor::from_vec(
        values(2, 3 * 37).iter().map(|v| v * 4.0).collect(),
        &[3, 37],
    )?;
    let r = compare_layer("GELU", dev, &|| Box::new(GELU::new()), &x, REL)?;
    let want: Vec<f64> = x
        .to_vec_f32()?
        .iter()
        .map(|&v| {
            let v = v as f64;
            0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2))
        })
        .collect();
    assert_f64("GELU (f64 erf)", &r.y, &want, 1e-6);
    let r = compare_layer("ReLU", dev, &|| Box::new(ReLU::new()), &x, REL)?;
    let xv = x.to_vec_f32()?;
    let want: Vec<f64> = xv.iter().map(|&v| v.max(0.0) as f64).collect();
    assert_f64("ReLU", &r.y, &want, 0.0);
    let dy = values(77, xv.len());
    let want: Vec<f64> = (0..xv.len())
        .map(|i| if xv[i] > 0.0 { dy[i] as f64 } else { 0.0 })
        .collect();
    assert_f64("ReLU dx", &r.dx, &want, 0.0);
    Ok(())
});

device_test!(layernorm_matches_the_cpu, |dev| {
    for (rows, c) in [(1usize, 1usize), (5, 17), (3, 129)] {
        let x = Tensor::from_vec(
            values(3, rows * c).iter().map(|v| v * 3.0 + 0.5).collect(),
            &[rows, c],
        )?;
        let make = || {
            let mut ln = LayerNorm::new(c).unwrap();
            // Not the ones / zeros init, so the parameters matter.
            let (w, b) = (values(4, c), values(5, c));
            ln.weight
                .set_data(Some(Tensor::from_vec(w, &[c]).unwrap()))
                .unwrap();
            ln.bias
                .set_data(Some(Tensor::from_vec(b, &[c]).unwrap()))
                .unwrap();
            Box::new(ln) as Box<dyn Module>
        };
        let r = compare_layer(&format!("LayerNorm({c})"), dev, &make, &x, REL)?;
        let (xv, w, b) = (x.to_vec_f32()?, values(4, c), values(5, c));
        let mut want = vec![0.0f64; rows * c];
        for r_ in 0..rows {
            let row: Vec<f64> = xv[r_ * c..(r_ + 1) * c].iter().map(|&v| v as f64).collect();
            let mean = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / c as f64;
            for j in 0..c {
                want[r_ * c + j] =
                    (row[j] - mean) / (var + 1e-5).sqrt() * w[j] as f64 + b[j] as f64;
            }
        }
        assert_f64("LayerNorm y (f64 reference)", &r.y, &want, 1e-4);
    }
    Ok(())
});

/// Naive f64 causal attention of `x (B, T, C)` with the module's projection weights.
fn attention_reference(m: &mut dyn Module, x: &Tensor, h: usize) -> Vec<f64> {
    let (b, t, c) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    let hd = c / h;
    let (wa, ba) = (param(m, "c_attn.weight"), param(m, "c_attn.bias"));
    let (wp, bp) = (param(m, "c_proj.weight"), param(m, "c_proj.bias"));
    let xv: Vec<f64> = x.to_vec_f32().unwrap().iter().map(|&v| v as f64).collect();
    let lin = |inp: &[f64], w: &[f64], bias: &[f64], i: usize, o: usize| -> Vec<f64> {
        let rows = inp.len() / i;
        let mut out = vec![0.0; rows * o];
        for r in 0..rows {
            for j in 0..o {
                out[r * o + j] =
                    bias[j] + (0..i).map(|p| inp[r * i + p] * w[j * i + p]).sum::<f64>();
            }
        }
        out
    };
    let qkv = lin(&xv, &wa, &ba, c, 3 * c);
    let mut y = vec![0.0f64; b * t * c];
    for bi in 0..b {
        for hi in 0..h {
            let at = |ti: usize, which: usize, d: usize| {
                qkv[(bi * t + ti) * 3 * c + which * c + hi * hd + d]
            };
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..hd).map(|d| at(i, 0, d) * at(j, 1, d)).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    y[(bi * t + i) * c + hi * hd + d] =
                        (0..=i).map(|j| e[j] / sum * at(j, 2, d)).sum::<f64>();
                }
            }
        }
    }
    lin(&y, &wp, &bp, c, c)
}

device_test!(attention_matches_the_cpu, |dev| {
    for (b, t, c, h) in [
        (1usize, 1usize, 1usize, 1usize),
        (2, 5, 21, 3),
        (1, 13, 8, 2),
    ] {
        let x = Tensor::from_vec(values(6, b * t * c), &[b, t, c])?;
        let make = || {
            let mut m = CausalSelfAttention::new(c, h, &InitKey::new(7)).unwrap();
            // Larger weights than GPT-2's init, so the softmax is far from uniform.
            let mut k = 0;
            nn::visit_parameters(&mut m, "", false, &mut |_, p| {
                k += 1;
                let n = p.numel();
                let v: Vec<f32> = values(100 + k, n).iter().map(|v| v * 0.8).collect();
                p.set_data(Some(Tensor::from_vec(v, p.shape()).unwrap()))
                    .unwrap();
                Ok(())
            })
            .unwrap();
            Box::new(m) as Box<dyn Module>
        };
        let what = format!("attention B={b} T={t} C={c} H={h}");
        let mut r = compare_layer(&what, dev, &make, &x, REL)?;
        let want = attention_reference(r.model.as_mut(), &x, h);
        assert_f64(&format!("{what} (f64 reference)"), &r.y, &want, 1e-5);
    }
    Ok(())
});

device_test!(embedding_and_block_match_the_cpu, |dev| {
    for (v, c, shape) in [(1usize, 1usize, vec![1usize]), (7, 3, vec![2, 5])] {
        let n: usize = shape.iter().product();
        let ids: Vec<i32> = (0..n).map(|i| ((i * 3 + 1) % v) as i32).collect();
        let make =
            || Box::new(Embedding::new(v, c, 1.0, &InitKey::new(8)).unwrap()) as Box<dyn Module>;
        let x = Tensor::from_vec(ids.clone(), &shape)?;
        let mut r = compare_layer(&format!("Embedding({v}, {c})"), dev, &make, &x, REL)?;
        let table = param(r.model.as_mut(), "weight");
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&id| table[id as usize * c..(id as usize + 1) * c].to_vec())
            .collect();
        assert_f64("Embedding gather", &r.y, &want, 0.0);
        assert_eq!(r.dx.numel(), 0, "ids have no gradient");
    }
    let x = Tensor::from_vec(values(9, 2 * 5 * 12), &[2, 5, 12])?;
    let make = || Box::new(Block::new(12, 3, &InitKey::new(9)).unwrap()) as Box<dyn Module>;
    compare_layer("Block(12, 3)", dev, &make, &x, 1e-4)?;
    Ok(())
});

device_test!(losses_match_the_cpu, |dev| {
    // Cross-entropy of (3, 5, 11) logits.
    let logits: Vec<f32> = values(10, 3 * 5 * 11).iter().map(|v| v * 4.0).collect();
    let targets: Vec<i32> = (0..15).map(|i| i * 7 % 11).collect();
    let l = Tensor::from_vec(logits.clone(), &[3, 5, 11])?;
    let t = Tensor::from_vec(targets.clone(), &[3, 5])?;
    let (want, wg) = loss::cross_entropy(&l, &t)?;
    let (got, g) = loss::cross_entropy(&l.to_device(dev)?, &t.to_device(dev)?)?;
    check("cross_entropy grad", dev, &g, &wg, REL);
    assert!(
        (got - want).abs() <= 1e-5 * want.abs(),
        "loss {got} vs {want}"
    );
    let mut w64 = 0.0f64;
    for (r, &y) in targets.iter().enumerate() {
        let row: Vec<f64> = logits[r * 11..(r + 1) * 11]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
        w64 += lse - row[y as usize];
    }
    assert!(
        (want as f64 - w64 / 15.0).abs() < 1e-5,
        "{want} vs f64 {}",
        w64 / 15.0
    );
    let bad = Tensor::from_vec(vec![0i32, 11, 2], &[3])?.to_device(dev)?;
    let r = loss::cross_entropy(
        &l.reshape(&[15, 11])?.view(0, &[3, 11])?.to_device(dev)?,
        &bad,
    );
    assert!(
        matches!(&r, Err(Error::InvalidArgument(m)) if m.contains("position 1")),
        "{r:?}"
    );
    // MSE and sum of a (7, 3) prediction.
    let (p, y) = (values(11, 21), values(12, 21));
    let (pt, yt) = (
        Tensor::from_vec(p.clone(), &[7, 3])?,
        Tensor::from_vec(y.clone(), &[7, 3])?,
    );
    let (want, wg) = loss::mse_loss(&pt, &yt)?;
    let (got, g) = loss::mse_loss(&pt.to_device(dev)?, &yt.to_device(dev)?)?;
    check("mse grad", dev, &g, &wg, REL);
    let w64 = p
        .iter()
        .zip(&y)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        / 21.0;
    assert!((got as f64 - w64).abs() < 1e-6 && (want as f64 - w64).abs() < 1e-6);
    let (got, g) = loss::sum_loss(&pt.to_device(dev)?)?;
    let (want, wg) = loss::sum_loss(&pt)?;
    check("sum grad", dev, &g, &wg, 0.0);
    assert!(
        (got - want).abs() < 1e-6
            && (want as f64 - p.iter().map(|&v| v as f64).sum::<f64>()).abs() < 1e-6
    );
    // An MLP trained through mse on the device.
    let make = || {
        let k = InitKey::new(13);
        Box::new(Sequential::new(vec![
            Box::new(Linear::new(3, 5, true, &k.child("0")).unwrap()),
            Box::new(ReLU::new()),
            Box::new(Linear::new(5, 3, false, &k.child("2")).unwrap()),
        ])) as Box<dyn Module>
    };
    compare_layer("Linear-ReLU-Linear", dev, &make, &pt, REL)?;
    Ok(())
});

fn tiny_gpt() -> GPT {
    let cfg = GptConfig {
        vocab_size: 31,
        block_size: 7,
        n_layer: 2,
        n_head: 3,
        n_embd: 12,
    };
    GPT::new(cfg, 5).unwrap()
}

device_test!(gpt_forward_backward_and_adamw_step_match_the_cpu, |dev| {
    let (b, t) = (3usize, 5usize);
    let toks: Vec<i32> = values(14, b * (t + 1))
        .iter()
        .map(|v| ((v + 1.0) * 15.5) as i32 % 31)
        .collect();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for r in 0..b {
        x.extend_from_slice(&toks[r * (t + 1)..r * (t + 1) + t]);
        y.extend_from_slice(&toks[r * (t + 1) + 1..(r + 1) * (t + 1)]);
    }
    let (mut cpu, mut gpu) = (tiny_gpt(), tiny_gpt());
    module_to_device(&mut gpu, dev)?;
    // eps 1e-3: the update of a tiny gradient then does not amplify its rounding.
    let cfg = AdamConfig {
        lr: 1e-2,
        eps: 1e-3,
        weight_decay: 0.1,
        ..AdamConfig::adamw()
    };
    let (mut oc, mut od) = (AdamW::new(cfg), AdamW::new(cfg));
    let cx = Context::train();
    let mut losses = Vec::new();
    for step in 0..3 {
        let (xc, yc) = (
            Tensor::from_vec(x.clone(), &[b, t])?,
            Tensor::from_vec(y.clone(), &[b, t])?,
        );
        let lc = cpu.forward(&xc, &cx)?;
        let ld = gpu.forward(&ids_on(x.clone(), &[b, t], dev), &cx)?;
        check(&format!("GPT logits, step {step}"), dev, &ld, &lc, 1e-4);
        let (loss_c, gc) = loss::cross_entropy(&lc, &yc)?;
        let (loss_d, gd) = loss::cross_entropy(&ld, &ids_on(y.clone(), &[b, t], dev))?;
        assert!(
            (loss_c - loss_d).abs() <= 1e-5 * loss_c,
            "loss {loss_d} vs {loss_c}"
        );
        losses.push(loss_c);
        cpu.backward(&gc, &cx)?;
        gpu.backward(&gd, &cx)?;
        for ((n, g), (_, gdv)) in named_grads(&mut cpu).iter().zip(&named_grads(&mut gpu)) {
            check(&format!("GPT grad {n}, step {step}"), dev, gdv, g, 1e-4);
        }
        oc.step(&fsdp::optim::parameters(&mut cpu))?;
        od.step(&fsdp::optim::parameters(&mut gpu))?;
        for ((n, p), (_, pd)) in named_params(&mut cpu).iter().zip(&named_params(&mut gpu)) {
            check(&format!("GPT {n} after step {step}"), dev, pd, p, 1e-4);
        }
        nn::zero_grad(&mut cpu);
        nn::zero_grad(&mut gpu);
    }
    // Near-uniform predictions at init, and learning on a fixed batch.
    assert!(
        (losses[0] - 31f32.ln()).abs() < 0.1,
        "initial loss {}",
        losses[0]
    );
    assert!(losses[2] < losses[0] - 0.01, "losses {losses:?}");
    // Optimizer state comes back to the host, equal on both devices.
    let (sc, sd) = (oc.state_dict()?, od.state_dict()?);
    for (a, bb) in sc.tensors.iter().zip(&sd.tensors) {
        let (a, bb) = (a.as_ref().unwrap(), bb.as_ref().unwrap());
        assert_eq!(a.step, bb.step);
        for ((n, va), (_, vb)) in a.buffers.iter().zip(&bb.buffers) {
            let scale = va.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            common::assert_close(&format!("AdamW {n}"), vb, va, 1e-3 * scale, 1e-3);
        }
    }
    Ok(())
});

device_test!(module_to_device_round_trips, |dev| {
    let mut m = tiny_gpt();
    // Gradients to move as well.
    let x = Tensor::from_vec((0..10).map(|i| i % 31).collect::<Vec<i32>>(), &[2, 5])?;
    let logits = m.forward(&x, &Context::train())?;
    m.backward(&loss::sum_loss(&logits)?.1, &Context::train())?;
    let (p0, g0) = (named_params(&mut m), named_grads(&mut m));
    assert_eq!(p0.len(), g0.len());
    module_to_device(&mut m, dev)?;
    nn::visit_parameters(&mut m, "", false, &mut |n, p| {
        assert_eq!(p.device(), dev, "{n}");
        assert_eq!(p.data().unwrap().device(), dev, "{n}");
        assert_eq!(p.grad().unwrap().device(), dev, "{n} grad");
        Ok(())
    })
    .unwrap();
    for ((n, a), (_, b)) in named_params(&mut m).iter().zip(&p0) {
        check(&format!("{n} moved"), dev, a, b, 0.0);
        assert_eq!(
            a.same_view(b),
            dev == Device::Cpu,
            "{n}: copied only when moved"
        );
    }
    module_to_device(&mut m, Device::Cpu)?;
    for ((n, a), (_, b)) in named_params(&mut m).iter().zip(&p0) {
        check(&format!("{n} back"), Device::Cpu, a, b, 0.0);
    }
    for ((n, a), (_, b)) in named_grads(&mut m).iter().zip(&g0) {
        check(&format!("{n} grad back"), Device::Cpu, a, b, 0.0);
    }
    // A model wrapped in FSDP is refused: its parameters are FlatParameter views.
    let err = fsdp::distributed::launch(&fsdp::distributed::LaunchOptions::new(1), |pg| {
        let mut f = fsdp::fsdp::FullyShardedDataParallel::new(
            Box::new(tiny_gpt()),
            pg,
            fsdp::fsdp::FsdpConfig::default(),
        )?;
        Ok(module_to_device(&mut f, dev).map_err(|e| e.to_string()))
    })?;
    assert!(
        matches!(&err[0], Err(m) if m.contains("FSDP unit")),
        "{err:?}"
    );
    // A layer and its input on different devices is a clear error, not a wrong result.
    if dev != Device::Cpu {
        let mut l = Linear::new(3, 2, true, &InitKey::new(1))?;
        let r = l.forward(&tensor_on(values(1, 3), &[1, 3], dev), &Context::train());
        assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
    }
    Ok(())
});

#[test]
fn gpt2_124m_preset() {
    let cfg = GptConfig::gpt2_124m(50257);
    assert_eq!(
        (
            cfg.n_layer,
            cfg.n_embd,
            cfg.n_head,
            cfg.block_size,
            cfg.vocab_size
        ),
        (12, 768, 12, 1024, 50257)
    );
    // Built on the meta device: shapes only. 124,439,808 parameters as OpenAI's GPT-2
    // small (the tied wte counted once).
    let mut m = nn::on_meta_device(|| GPT::new(cfg, 0)).unwrap();
    assert_eq!(nn::num_parameters(&mut m), 124_439_808);
    let mut bytes = nn::on_meta_device(|| GPT::new(GptConfig::gpt2_124m(256), 0)).unwrap();
    assert_eq!(
        nn::num_parameters(&mut bytes),
        124_439_808 - (50257 - 256) * 768
    );
}

device_test!(batchnorm1d_matches_the_cpu_with_buffers_on_device, |dev| {
    let make = || Box::new(nn::BatchNorm1d::new(5).unwrap()) as Box<dyn Module>;
    for shape in [&[4usize, 5][..], &[3, 5, 2]] {
        let n: usize = shape.iter().product();
        let x = Tensor::from_vec(values(3, n), shape)?;
        let mut r = compare_layer("BatchNorm1d", dev, &make, &x, REL)?;
        // module_to_device moves the buffers; the forward updates them there, to the CPU's
        // values (the same host loops compute both).
        let mut m = make();
        module_to_device(m.as_mut(), dev)?;
        m.forward(&x.to_device(dev)?, &Context::train())?;
        let cpu = nn::named_buffers(r.model.as_mut(), false)?;
        let on_dev = nn::named_buffers(m.as_mut(), false)?;
        assert_eq!(on_dev.len(), 3);
        for ((name, t), (_, c)) in on_dev.iter().zip(&cpu) {
            assert_eq!(t.device(), dev, "{name}");
            assert_eq!(t.to_vec_f64()?, c.to_vec_f64()?, "{name}");
        }
        // Eval mode: the running stats, on the device.
        let ye = m.forward(&x.to_device(dev)?, &Context::eval())?;
        let yc = r.model.forward(&x, &Context::eval())?;
        check("BatchNorm1d eval y", dev, &ye, &yc, REL);
    }
    Ok(())
});

device_test!(fsdp_batchnorm_buffers_live_on_device_id, |dev| {
    use fsdp::distributed::{launch, LaunchOptions};
    use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel};
    // Two ranks, each its own batch: the running stats (moved to device_id at wrap time)
    // are updated there, and equal the CPU run's.
    let run = |d: Device| {
        launch(&LaunchOptions::new(2), move |pg| {
            let r = pg.rank();
            let m = Sequential::new(vec![
                Box::new(Linear::new(3, 4, true, &InitKey::new(2))?),
                Box::new(nn::BatchNorm1d::new(4)?),
            ]);
            let cfg = FsdpConfig {
                device_id: Some(d),
                ..FsdpConfig::default()
            };
            let mut m = FullyShardedDataParallel::new(Box::new(m), pg, cfg)?;
            for step in 0..2 {
                let x = Tensor::from_vec(values(10 * r as u64 + step, 15), &[5, 3])?;
                let y = m.forward(&x.to_device(d)?, &Context::train())?;
                let (_, dy) = loss::sum_loss(&y)?;
                m.backward(&dy, &Context::train())?;
                m.zero_grad();
            }
            let bufs = nn::named_buffers(&mut m, false)?;
            for (n, t) in &bufs {
                assert_eq!(t.device(), d, "{n}");
            }
            bufs.into_iter()
                .map(|(_, t)| t.to_device(Device::Cpu))
                .collect::<Result<Vec<_>>>()
        })
    };
    let (cpu, on_dev) = (run(Device::Cpu)?, run(dev)?);
    for (r, (c, g)) in cpu.iter().zip(&on_dev).enumerate() {
        for (c, g) in c.iter().zip(g) {
            // Host copies (the device was checked above).
            let what = format!("rank {r} buffer");
            common::assert_close(&what, &g.to_vec_f32()?, &c.to_vec_f32()?, 1e-6, REL);
        }
    }
    assert_ne!(cpu[0][0].to_vec_f32()?, cpu[1][0].to_vec_f32()?);
    Ok(())
});
