//! Zero-size dimensions in every layer, loss and GEMM, on every device (see
//! tests/common/device.rs): `Linear(8, 0)`, `Linear(0, 8)`, empty batches, `LayerNorm(0)`,
//! an embedding of width 0, attention and GPT on empty batches, and losses of empty
//! batches. Values follow PyTorch where it defines them: `Linear(0, out)` gives the bias
//! broadcast and a weight gradient of shape `(out, 0)`; a mean over an empty batch is NaN.

use crate::common;
use crate::device;
use crate::device_test;
use crate::zero_models;

use common::values;
use device::{check, tensor_on};
use fsdp::backend::Device;
use fsdp::nn::{
    self, loss, module_to_device, Block, CausalSelfAttention, Context, Embedding, GptConfig,
    InitKey, LayerNorm, Linear, Module, ReLU, GELU, GPT,
};
use fsdp::ops::{self, MatmulDims, Transpose};
use fsdp::optim::{AdamConfig, AdamW, Optimizer};
use fsdp::tensor::Tensor;
use fsdp::{Error, Result};

/// `(name, shape, grad)` of every parameter below `m`, grads on the host.
fn grads(m: &mut dyn Module) -> Vec<(String, Vec<usize>, Option<Vec<f32>>)> {
    let mut out = Vec::new();
    nn::visit_parameters(m, "", false, &mut |n, p| {
        let g = p.grad().map(|g| {
            assert_eq!(g.shape(), p.shape(), "{n}: gradient shape");
            g.to_vec_f32().unwrap()
        });
        out.push((n.to_string(), p.shape().to_vec(), g));
        Ok(())
    })
    .unwrap();
    out
}

/// Runs `make()` forward on `x` and backward on `dy = values(77)` of the output's shape on
/// `dev`, and the same on the CPU; checks the output, input gradient and parameter
/// gradients agree (bitwise on the CPU) and live on `dev`. Returns `(y, dx, model)` of `dev`.
fn run(
    what: &str,
    dev: Device,
    make: &dyn Fn() -> Box<dyn Module>,
    x: &Tensor,
) -> Result<(Tensor, Tensor, Box<dyn Module>)> {
    let cx = Context::train();
    let (mut cpu, mut on) = (make(), make());
    module_to_device(on.as_mut(), dev)?;
    let y = cpu.forward(x, &cx)?;
    let yd = on.forward(&x.to_device(dev)?, &cx)?;
    check(&format!("{what} y"), dev, &yd, &y, device::REL);
    let dy = Tensor::from_vec(values(77, y.numel()), y.shape())?;
    let dx = cpu.backward(&dy, &cx)?;
    let dxd = on.backward(&dy.to_device(dev)?, &cx)?;
    if x.dtype() == fsdp::tensor::DType::F32 {
        assert_eq!(dx.shape(), x.shape(), "{what}: dx has the input's shape");
    }
    check(&format!("{what} dx"), dev, &dxd, &dx, device::REL);
    let mut gd = Vec::new();
    nn::visit_parameters(on.as_mut(), "", false, &mut |n, p| {
        gd.extend(p.grad().map(|g| (n.to_string(), g.clone())));
        Ok(())
    })
    .unwrap();
    let mut gc = Vec::new();
    nn::visit_parameters(cpu.as_mut(), "", false, &mut |n, p| {
        gc.extend(p.grad().map(|g| (n.to_string(), g.clone())));
        Ok(())
    })
    .unwrap();
    assert_eq!(gc.len(), gd.len(), "{what}: gradients");
    for ((n, g), (_, d)) in gc.iter().zip(&gd) {
        check(&format!("{what} grad {n}"), dev, d, g, device::REL);
    }
    Ok((yd, dxd, on))
}

/// `(name, shape, values)` of every parameter of a trained model.
type Trained = Vec<(String, Vec<usize>, Vec<f32>)>;

fn empty(shape: &[usize]) -> Tensor {
    Tensor::from_vec(Vec::<f32>::new(), shape).unwrap()
}

device_test!(linear_with_zero_out_features, |dev| {
    // Linear(8, 0): y (3, 0); dx = dy (3, 0) @ W (0, 8) = zeros (3, 8); grads (0, 8), (0).
    let x = Tensor::from_vec(values(1, 24), &[3, 8])?;
    let make = || Box::new(Linear::new(8, 0, true, &InitKey::new(3)).unwrap()) as Box<dyn Module>;
    let (y, dx, mut m) = run("Linear(8, 0)", dev, &make, &x)?;
    assert_eq!(y.shape(), [3, 0]);
    assert_eq!(dx.to_vec_f32()?, vec![0.0; 24]);
    let g = grads(m.as_mut());
    assert_eq!(
        g,
        vec![
            ("weight".into(), vec![0, 8], Some(vec![])),
            ("bias".into(), vec![0], Some(vec![]))
        ]
    );
    // Leading dimensions are kept: (2, 3, 8) -> (2, 3, 0).
    let x3 = Tensor::from_vec(values(2, 48), &[2, 3, 8])?;
    let (y, dx, _) = run("Linear(8, 0) 3-D", dev, &make, &x3)?;
    assert_eq!((y.shape(), dx.shape()), (&[2, 3, 0][..], &[2, 3, 8][..]));
    Ok(())
});

device_test!(linear_with_zero_in_features, |dev| {
    // PyTorch: Linear(0, 8)'s bias starts at zeros (bound 1/sqrt(fan_in) only for fan_in > 0).
    let fresh = Linear::new(0, 8, true, &InitKey::new(4))?;
    assert_eq!(
        fresh.bias.as_ref().unwrap().data()?.to_vec_f32()?,
        vec![0.0; 8]
    );
    assert_eq!(fresh.weight.shape(), [8, 0]);
    let b = values(5, 8);
    let make = || {
        let mut l = Linear::new(0, 8, true, &InitKey::new(4)).unwrap();
        let bias = Tensor::from_vec(values(5, 8), &[8]).unwrap();
        l.bias.as_mut().unwrap().set_data(Some(bias)).unwrap();
        Box::new(l) as Box<dyn Module>
    };
    let (y, dx, mut m) = run("Linear(0, 8)", dev, &make, &empty(&[3, 0]))?;
    // y = the bias broadcast over the 3 rows, exactly.
    let want: Vec<f32> = (0..3).flat_map(|_| b.clone()).collect();
    assert_eq!(y.shape(), [3, 8]);
    assert_eq!(y.to_vec_f32()?, want);
    assert_eq!(dx.shape(), [3, 0]);
    // Weight grad (8, 0); bias grad = the column sums of dy (3, 8).
    let dy = values(77, 24);
    let colsum: Vec<f32> = (0..8)
        .map(|j| (0..3).map(|r| dy[r * 8 + j] as f64).sum::<f64>() as f32)
        .collect();
    let g = grads(m.as_mut());
    assert_eq!((g[0].0.as_str(), &g[0].1), ("weight", &vec![8, 0]));
    assert_eq!(g[0].2.as_deref(), Some(&[][..]));
    assert_eq!((g[1].0.as_str(), &g[1].1), ("bias", &vec![8]));
    common::assert_close(
        "Linear(0, 8) bias grad",
        g[1].2.as_ref().unwrap(),
        &colsum,
        1e-6,
        1e-6,
    );
    // Without a bias the output is zeros.
    let make = || Box::new(Linear::new(0, 8, false, &InitKey::new(4)).unwrap()) as Box<dyn Module>;
    let (y, _, _) = run("Linear(0, 8, no bias)", dev, &make, &empty(&[2, 0]))?;
    assert_eq!(y.to_vec_f32()?, vec![0.0; 16]);
    Ok(())
});

device_test!(linear_with_an_empty_batch, |dev| {
    for shape in [vec![0usize, 4], vec![2, 0, 4]] {
        let make =
            || Box::new(Linear::new(4, 8, true, &InitKey::new(6)).unwrap()) as Box<dyn Module>;
        let (y, dx, mut m) = run("Linear(4, 8) of no rows", dev, &make, &empty(&shape))?;
        let mut ys = shape.clone();
        *ys.last_mut().unwrap() = 8;
        assert_eq!((y.shape(), dx.shape()), (&ys[..], &shape[..]));
        // No rows: every gradient is zeros of the parameter's shape.
        for (n, s, g) in grads(m.as_mut()) {
            let g = g.unwrap_or_else(|| panic!("{n} has no gradient"));
            assert_eq!(g, vec![0.0; s.iter().product()], "{n}");
        }
    }
    Ok(())
});

device_test!(layer_norm_of_width_zero_and_of_no_rows, |dev| {
    let make = || Box::new(LayerNorm::new(0).unwrap()) as Box<dyn Module>;
    let (y, dx, mut m) = run("LayerNorm(0)", dev, &make, &empty(&[3, 0]))?;
    assert_eq!((y.shape(), dx.shape()), (&[3, 0][..], &[3, 0][..]));
    let shapes: Vec<Vec<usize>> = grads(m.as_mut()).into_iter().map(|g| g.1).collect();
    assert_eq!(shapes, vec![vec![0], vec![0]]);
    let make = || Box::new(LayerNorm::new(4).unwrap()) as Box<dyn Module>;
    let (y, _, mut m) = run("LayerNorm(4) of no rows", dev, &make, &empty(&[0, 4]))?;
    assert_eq!(y.shape(), [0, 4]);
    for (n, _, g) in grads(m.as_mut()) {
        assert_eq!(g, Some(vec![0.0; 4]), "{n}");
    }
    Ok(())
});

device_test!(activations_of_empty_tensors, |dev| {
    for shape in [[0usize, 4], [4, 0]] {
        let relu = || Box::new(ReLU::new()) as Box<dyn Module>;
        let gelu = || Box::new(GELU::new()) as Box<dyn Module>;
        for (name, make) in [
            ("ReLU", &relu as &dyn Fn() -> Box<dyn Module>),
            ("GELU", &gelu),
        ] {
            let (y, dx, _) = run(name, dev, make, &empty(&shape))?;
            assert_eq!((y.shape(), dx.shape()), (&shape[..], &shape[..]));
        }
    }
    Ok(())
});

device_test!(embedding_of_width_zero_and_of_no_ids, |dev| {
    let make = || Box::new(Embedding::new(5, 0, 1.0, &InitKey::new(7)).unwrap()) as Box<dyn Module>;
    let ids = Tensor::from_vec(vec![1i32, 4], &[2])?;
    let (y, _, mut m) = run("Embedding(5, 0)", dev, &make, &ids)?;
    assert_eq!(y.shape(), [2, 0]);
    assert_eq!(grads(m.as_mut())[0].1, vec![5, 0]);
    // A bad id is still an error with a width of 0, naming the id and the vocabulary.
    let mut e = make();
    module_to_device(e.as_mut(), dev)?;
    let bad = Tensor::from_vec(vec![1i32, 5], &[2])?.to_device(dev)?;
    match e.forward(&bad, &Context::train()) {
        Err(Error::InvalidArgument(msg)) => {
            assert!(msg.contains("id 5") && msg.contains("0..5"), "{msg}")
        }
        other => panic!("Embedding(5, 0) of id 5: {other:?}"),
    }
    // No ids: (0, 3) and (2, 0, 3) outputs; the table's gradient is zeros.
    let make = || Box::new(Embedding::new(5, 3, 1.0, &InitKey::new(7)).unwrap()) as Box<dyn Module>;
    for shape in [vec![0usize], vec![2, 0]] {
        let ids = Tensor::from_vec(Vec::<i32>::new(), &shape)?;
        let (y, _, mut m) = run("Embedding(5, 3) of no ids", dev, &make, &ids)?;
        let mut ys = shape.clone();
        ys.push(3);
        assert_eq!(y.shape(), &ys[..]);
        assert_eq!(grads(m.as_mut())[0].2, Some(vec![0.0; 15]));
    }
    Ok(())
});

device_test!(attention_and_gpt_on_empty_batches, |dev| {
    // (B, T, C) with B = 0, T = 0, and heads of width 0.
    for (b, t, c, h) in [(0usize, 3usize, 6usize, 2usize), (2, 0, 6, 2), (2, 3, 0, 2)] {
        let make = || {
            Box::new(CausalSelfAttention::new(c, h, &InitKey::new(8)).unwrap()) as Box<dyn Module>
        };
        let what = format!("attention B={b} T={t} C={c}");
        let (y, dx, mut m) = run(&what, dev, &make, &empty(&[b, t, c]))?;
        assert_eq!((y.shape(), dx.shape()), (&[b, t, c][..], &[b, t, c][..]));
        for (n, s, g) in grads(m.as_mut()) {
            // The projections' gradients are zeros (no tokens), of the parameters' shapes.
            assert_eq!(g, Some(vec![0.0; s.iter().product()]), "{what}: {n}");
        }
    }
    let make = || Box::new(Block::new(6, 2, &InitKey::new(9)).unwrap()) as Box<dyn Module>;
    let (y, _, _) = run("Block of no rows", dev, &make, &empty(&[0, 3, 6]))?;
    assert_eq!(y.shape(), [0, 3, 6]);
    let cfg = GptConfig {
        vocab_size: 7,
        block_size: 4,
        n_layer: 1,
        n_head: 2,
        n_embd: 4,
    };
    let make = || Box::new(GPT::new(cfg, 1).unwrap()) as Box<dyn Module>;
    for shape in [[0usize, 3], [2, 0]] {
        let ids = Tensor::from_vec(Vec::<i32>::new(), &shape)?;
        let (logits, _, mut m) = run("GPT of no tokens", dev, &make, &ids)?;
        assert_eq!(logits.shape(), [shape[0], shape[1], 7]);
        for (n, s, g) in grads(m.as_mut()) {
            assert_eq!(g, Some(vec![0.0; s.iter().product()]), "GPT {shape:?}: {n}");
        }
    }
    Ok(())
});

device_test!(losses_of_empty_batches, |dev| {
    // Mean reductions over no elements are NaN, as in PyTorch; the gradient is empty.
    let logits = empty(&[0, 5]).to_device(dev)?;
    let targets = Tensor::from_vec(Vec::<i32>::new(), &[0])?.to_device(dev)?;
    let (l, g) = loss::cross_entropy(&logits, &targets)?;
    assert!(l.is_nan(), "cross_entropy of no rows: {l}");
    assert_eq!((g.shape(), g.device()), (&[0, 5][..], dev));
    let p = empty(&[0, 3]).to_device(dev)?;
    let (l, g) = loss::mse_loss(&p, &p)?;
    assert!(l.is_nan(), "mse_loss of no elements: {l}");
    assert_eq!((g.shape(), g.device()), (&[0, 3][..], dev));
    // A sum over no elements is +0 (torch.sum), its gradient empty ones.
    let (l, g) = loss::sum_loss(&p)?;
    assert_eq!(
        l.to_bits(),
        0.0f32.to_bits(),
        "sum_loss of no elements: {l}"
    );
    assert_eq!(g.shape(), [0, 3]);
    // No classes with rows: every target is out of range.
    let logits = empty(&[2, 0]).to_device(dev)?;
    let targets = Tensor::from_vec(vec![0i32, 0], &[2])?.to_device(dev)?;
    match loss::cross_entropy(&logits, &targets) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("outside 0..0"), "{msg}"),
        other => panic!("cross_entropy over 0 classes: {other:?}"),
    }
    // Mismatched leading sizes are still refused when V = 0.
    let targets = Tensor::from_vec(vec![0i32; 3], &[3])?.to_device(dev)?;
    assert!(matches!(
        loss::cross_entropy(&logits, &targets),
        Err(Error::ShapeMismatch { .. })
    ));
    Ok(())
});

device_test!(gemms_and_bias_ops_with_a_zero_dimension, |dev| {
    let t = |v: Vec<f32>, s: &[usize]| tensor_on(v, s, dev);
    // k = 0: out (2, 3) = a (2, 0) @ b (0, 3) is zeros (cuBLAS: beta * C with beta 0);
    // accumulating adds nothing.
    for trans in [Transpose::NN, Transpose::NT, Transpose::TN] {
        let a = t(vec![], if trans.a { &[0, 2] } else { &[2, 0] });
        let b = t(vec![], if trans.b { &[3, 0] } else { &[0, 3] });
        let out = t(vec![7.0; 6], &[2, 3]);
        ops::matmul(&out, &a, &b, MatmulDims::new(2, 0, 3, trans), true)?;
        assert_eq!(
            out.to_vec_f32()?,
            vec![7.0; 6],
            "{trans:?} += empty product"
        );
        ops::matmul(&out, &a, &b, MatmulDims::new(2, 0, 3, trans), false)?;
        assert_eq!(out.to_vec_f32()?, vec![0.0; 6], "{trans:?} = empty product");
    }
    // m = 0 and n = 0: nothing to write; a batch of 0 products.
    let a = t(values(1, 8), &[2, 4]);
    ops::matmul(
        &t(vec![], &[0, 2]),
        &t(vec![], &[0, 4]),
        &t(values(1, 8), &[4, 2]),
        MatmulDims::new(0, 4, 2, Transpose::NN),
        false,
    )?;
    ops::matmul(
        &t(vec![], &[2, 0]),
        &a,
        &t(vec![], &[4, 0]),
        MatmulDims::new(2, 4, 0, Transpose::NN),
        false,
    )?;
    ops::matmul_batched(
        &t(vec![], &[0]),
        &t(vec![], &[0]),
        &t(vec![], &[0]),
        MatmulDims::new(2, 3, 4, Transpose::NN),
        0,
        false,
    )?;
    // F.linear with in = 0 is the bias per row; with out = 0 an empty (.., 0).
    let y = ops::linear(
        &t(vec![], &[2, 0]),
        &t(vec![], &[3, 0]),
        Some(&t(vec![1.0, 2.0, 3.0], &[3])),
    )?;
    assert_eq!(y.to_vec_f32()?, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    let y = ops::linear(&a, &t(vec![], &[0, 4]), Some(&t(vec![], &[0])))?;
    assert_eq!(y.shape(), [2, 0]);
    // Bias ops over no rows or no columns.
    let db = t(vec![5.0; 3], &[3]);
    ops::bias_grad(&t(vec![], &[0, 3]), &db)?;
    assert_eq!(
        db.to_vec_f32()?,
        vec![5.0; 3],
        "a sum of no rows adds nothing"
    );
    ops::bias_add_(&t(vec![], &[0, 3]), &db)?;
    ops::bias_add_(&t(vec![], &[4, 0]), &t(vec![], &[0]))?;
    ops::bias_grad(&t(vec![], &[4, 0]), &t(vec![], &[0]))?;
    Ok(())
});

device_test!(an_empty_branch_leaves_training_unchanged, |dev| {
    // The model with a zero-size branch (no bias, so it adds zeros) trains its other
    // parameters exactly as the same model without the branch: AdamW, 3 steps, on `dev`.
    let train = |mut m: Box<dyn Module>| -> Result<Trained> {
        module_to_device(m.as_mut(), dev)?;
        let mut opt = AdamW::new(AdamConfig {
            lr: 1e-2,
            ..AdamConfig::adamw()
        });
        for step in 0..3 {
            let (x, y) = zero_models::batch(step, 0, 12);
            let out = m.forward(&x.to_device(dev)?, &Context::train())?;
            let (_, g) = loss::mse_loss(&out, &y.to_device(dev)?)?;
            m.backward(&g, &Context::train())?;
            opt.step(&fsdp::optim::parameters(m.as_mut()))?;
            nn::zero_grad(m.as_mut());
        }
        let mut out = Vec::new();
        nn::visit_parameters(m.as_mut(), "", false, &mut |n, p| {
            out.push((
                n.to_string(),
                p.shape().to_vec(),
                p.data().unwrap().to_vec_f32().unwrap(),
            ));
            Ok(())
        })
        .unwrap();
        Ok(out)
    };
    let with = train(zero_models::with_empty_branch(11, false))?;
    let without = train(zero_models::without_empty_branch(11))?;
    let mut compared = 0;
    for (n, s, v) in &with {
        if let Some((_, want)) = zero_models::EMPTY_PARAMS.iter().find(|(e, _)| e == n) {
            assert_eq!((s.as_slice(), v.len()), (*want, 0), "{n}");
            continue;
        }
        let (_, ws, wv) = without
            .iter()
            .find(|(wn, _, _)| *wn == zero_models::same_name(n))
            .unwrap_or_else(|| panic!("{n} has no counterpart"));
        assert_eq!(s, ws, "{n}: shape");
        assert_eq!(
            v, wv,
            "{n}: trained values differ from the model without the branch"
        );
        compared += 1;
    }
    assert_eq!(compared, 5, "every non-empty parameter compared");
    Ok(())
});
