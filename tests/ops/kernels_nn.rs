//! The layer, optimizer and GEMM kernels against the product code (nn modules, losses,
//! optimizers, the CPU GEMM), on every backend (see tests/ops/kernels.rs for the scheme).

use crate::backend;
use crate::backend_optim;
use crate::backend_test;
use crate::common;

use backend::Backend;
use backend_optim::Opt;
use common::{assert_close, values};
use fsdp::backend::cpu::gemm::Transpose;
use fsdp::backend::cpu::kernels::HeadDims;
use fsdp::nn::{Context, Module};
use fsdp::optim::{AdamConfig, SgdConfig};
use fsdp::tensor::{DType, Tensor};
use fsdp::Error;

/// f32 tolerance for row reductions summed in another order: a few ulps of the row's
/// magnitude.
const ATOL: f32 = 1e-5;
const RTOL: f32 = 1e-4;

backend_test!(layernorm_matches_the_module, |b| {
    for (rows, c) in [
        (1usize, 1usize),
        (3, 7),
        (5, 64),
        (17, 129),
        (2, 1031),
        (75, 70),
    ] {
        let mut ln = fsdp::nn::LayerNorm::new(c)?;
        let (w, bias) = (values(10, c), values(11, c));
        ln.weight
            .set_data(Some(Tensor::from_vec(w.clone(), &[c])?))?;
        ln.bias
            .set_data(Some(Tensor::from_vec(bias.clone(), &[c])?))?;
        let x: Vec<f32> = values(12, rows * c).iter().map(|v| v * 3.0 + 0.5).collect();
        let dy = values(13, rows * c);
        let cx = Context::train();
        let y = ln.forward(&Tensor::from_vec(x.clone(), &[rows, c])?, &cx)?;
        let (gy, xhat, rstd) = b.layernorm_fwd(&x, &w, &bias, 1e-5)?;
        assert_close(
            &format!("layernorm y {rows}x{c} on {}", b.name()),
            &gy,
            &y.to_vec_f32()?,
            ATOL,
            RTOL,
        );
        fsdp::nn::zero_grad(&mut ln);
        let dx = ln.backward(&Tensor::from_vec(dy.clone(), &[rows, c])?, &cx)?;
        let (gdx, gdw, gdb) = b.layernorm_bwd(&dy, &xhat, &rstd, &w)?;
        let what = format!("layernorm {rows}x{c} on {}", b.name());
        assert_close(&format!("{what} dx"), &gdx, &dx.to_vec_f32()?, ATOL, RTOL);
        let wg = ln
            .weight
            .grad()
            .map(|g| g.to_vec_f32())
            .transpose()?
            .unwrap_or_default();
        let bg = ln
            .bias
            .grad()
            .map(|g| g.to_vec_f32())
            .transpose()?
            .unwrap_or_default();
        assert_close(&format!("{what} dw"), &gdw, &wg, ATOL, RTOL);
        assert_close(&format!("{what} db"), &gdb, &bg, ATOL, RTOL);
    }
    Ok(())
});

backend_test!(attention_permutes_are_the_head_layouts, |b| {
    for d in [
        HeadDims {
            b: 1,
            t: 1,
            h: 1,
            hd: 1,
        },
        HeadDims {
            b: 2,
            t: 5,
            h: 3,
            hd: 7,
        },
        HeadDims {
            b: 3,
            t: 17,
            h: 4,
            hd: 8,
        },
    ] {
        let qkv = values(14, 3 * d.numel());
        let ((pieces, merged), c) = (b.qkv(&qkv, d)?, d.h * d.hd);
        for (which, piece) in pieces.iter().enumerate() {
            for bi in 0..d.b {
                for hi in 0..d.h {
                    for ti in 0..d.t {
                        for di in 0..d.hd {
                            let got = piece[((bi * d.h + hi) * d.t + ti) * d.hd + di];
                            let want = qkv[(bi * d.t + ti) * 3 * c + which * c + hi * d.hd + di];
                            assert_eq!(got, want, "split_qkv on {}", b.name());
                        }
                    }
                }
            }
        }
        assert_eq!(merged, qkv, "merge_qkv(split_qkv) on {}", b.name());
        let yh = values(15, d.numel());
        let (y, back) = b.heads(&yh, d)?;
        assert_eq!(back, yh, "split_heads(merge_heads) on {}", b.name());
        let (bi, hi, ti) = (d.b - 1, d.h - 1, d.t - 1);
        assert_eq!(
            y[((bi * d.t + ti) * d.h + hi) * d.hd],
            yh[((bi * d.h + hi) * d.t + ti) * d.hd]
        );
    }
    Ok(())
});

backend_test!(causal_softmax_forward_and_backward, |b| {
    for (rows_per, t) in [(1usize, 1usize), (2, 5), (3, 64), (1, 257)] {
        let rows = rows_per * t;
        let s: Vec<f32> = values(16, rows * t).iter().map(|v| v * 10.0).collect();
        let dp = values(17, rows * t);
        let scale = 0.35f32;
        let (p, ds) = b.softmax(&s, &dp, t, scale)?;
        // f64 oracle.
        let (mut wp, mut wds) = (vec![0.0f32; rows * t], vec![0.0f32; rows * t]);
        for r in 0..rows {
            let i = r % t;
            let row = &s[r * t..(r + 1) * t];
            let max = row[..=i]
                .iter()
                .map(|&v| (v * scale) as f64)
                .fold(f64::MIN, f64::max);
            let e: Vec<f64> = row[..=i]
                .iter()
                .map(|&v| ((v * scale) as f64 - max).exp())
                .collect();
            let sum: f64 = e.iter().sum();
            let dot: f64 = (0..=i).map(|j| e[j] / sum * dp[r * t + j] as f64).sum();
            for j in 0..=i {
                wp[r * t + j] = (e[j] / sum) as f32;
                wds[r * t + j] =
                    ((e[j] / sum) * (dp[r * t + j] as f64 - dot) * scale as f64) as f32;
            }
        }
        assert_close(
            &format!("softmax p T={t} on {}", b.name()),
            &p,
            &wp,
            1e-6,
            1e-5,
        );
        assert_close(
            &format!("softmax ds T={t} on {}", b.name()),
            &ds,
            &wds,
            1e-6,
            1e-4,
        );
    }
    Ok(())
});

backend_test!(cross_entropy_matches_the_loss, |b| {
    for (n, v) in [(1usize, 1usize), (1, 2), (7, 13), (33, 65), (4, 1031)] {
        let logits: Vec<f32> = values(18, n * v).iter().map(|x| x * 5.0).collect();
        let targets: Vec<i32> = (0..n).map(|i| ((i * 7 + 3) % v) as i32).collect();
        let (want_loss, want_grad) = fsdp::nn::loss::cross_entropy(
            &Tensor::from_vec(logits.clone(), &[n, v])?,
            &Tensor::from_vec(targets.clone(), &[n])?,
        )?;
        let (losses, grad) = b.cross_entropy(&logits, &targets, 1.0 / n as f32)?;
        let loss = (losses.iter().map(|&l| l as f64).sum::<f64>() / n as f64) as f32;
        assert_close(
            &format!("cross_entropy loss on {}", b.name()),
            &[loss],
            &[want_loss],
            1e-5,
            1e-5,
        );
        assert_close(
            &format!("cross_entropy grad on {}", b.name()),
            &grad,
            &want_grad.to_vec_f32()?,
            1e-7,
            1e-4,
        );
    }
    let bad = b.cross_entropy(&[0.0; 6], &[0, 5, -1], 1.0 / 3.0);
    assert!(
        matches!(&bad, Err(Error::InvalidArgument(m)) if m.contains("position 1")),
        "bad target on {}: {bad:?}",
        b.name()
    );
    Ok(())
});

backend_test!(embedding_matches_lookup_and_backward, |b| {
    for (n, v, c) in [
        (1usize, 1usize, 1usize),
        (9, 5, 3),
        (64, 17, 33),
        (300, 7, 8),
    ] {
        let table = values(19, v * c);
        let ids: Vec<i32> = (0..n).map(|i| ((i * 5 + 1) % v) as i32).collect();
        let dout = values(20, n * c);
        let grad0 = values(21, v * c);
        let (out, grad) = b.embedding(&ids, &table, c, &dout, &grad0)?;
        let want = fsdp::nn::embedding_lookup(&Tensor::from_vec(table.clone(), &[v, c])?, &ids)?;
        assert_eq!(out, want, "embedding_fwd on {}", b.name());
        let mut want_g = grad0.clone();
        fsdp::nn::embedding_backward(&mut want_g, &ids, &dout, c);
        // Repeated ids add atomically on CUDA, in any order.
        assert_close(
            &format!("embedding_bwd on {}", b.name()),
            &grad,
            &want_g,
            1e-6,
            1e-5,
        );
    }
    let bad = b.embedding(&[0, 3], &[0.0; 6], 2, &[0.0; 4], &[0.0; 6]);
    assert!(
        matches!(&bad, Err(Error::InvalidArgument(m)) if m.contains("position 1")),
        "bad id on {}: {bad:?}",
        b.name()
    );
    Ok(())
});

backend_test!(fused_optimizers_match_torch_rules_bitwise, |b| {
    let lens = [1usize, 0, 7, 1031, 33];
    let params: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| values(30 + i as u64, l))
        .collect();
    let grads: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| values(40 + i as u64, l))
        .collect();
    let sgd = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 0.01,
        nesterov: false,
    };
    let cases = [
        (
            "sgd",
            Opt::Sgd(SgdConfig {
                lr: 0.05,
                ..SgdConfig::default()
            }),
        ),
        ("sgd momentum", Opt::Sgd(sgd)),
        (
            "sgd nesterov",
            Opt::Sgd(SgdConfig {
                nesterov: true,
                dampening: 0.0,
                ..sgd
            }),
        ),
        (
            "adam",
            Opt::Adam(
                AdamConfig {
                    weight_decay: 0.1,
                    ..AdamConfig::adam()
                },
                false,
            ),
        ),
        (
            "adamw",
            Opt::Adam(
                AdamConfig {
                    lr: 0.01,
                    ..AdamConfig::adamw()
                },
                true,
            ),
        ),
    ];
    for (name, opt) in cases {
        let got = b.optimize(&params, &grads, opt, 3)?;
        let want = Backend::Cpu.optimize(&params, &grads, opt, 3)?;
        for (g, w) in got.iter().zip(&want) {
            let (gb, wb): (Vec<u32>, Vec<u32>) = (
                g.iter().map(|v| v.to_bits()).collect(),
                w.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(gb, wb, "{name} on {}", b.name());
        }
    }
    Ok(())
});

backend_test!(gemm_matches_the_cpu_gemm, |b| {
    let shapes = [
        (1usize, 1usize, 1usize),
        (7, 13, 5),
        (64, 33, 17),
        (3, 0, 4),
        (0, 5, 2),
        (129, 257, 65),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (m, k, n) in shapes {
            for trans in [Transpose::NN, Transpose::NT, Transpose::TN] {
                let (a, bm) = (values(50, m * k), values(51, k * n));
                let got = b.gemm(&a, &bm, (m, k, n), trans, dtype)?;
                let want = Backend::Cpu.gemm(&a, &bm, (m, k, n), trans, dtype)?;
                // Same (rounded) inputs, f32 accumulation in another order.
                let tol = 1e-6 * (k as f32).max(1.0);
                assert_close(
                    &format!("gemm {dtype} {m}x{k}x{n} {trans:?} on {}", b.name()),
                    &got,
                    &want,
                    tol,
                    1e-5,
                );
            }
        }
    }
    Ok(())
});
