//! Calls that would train wrong are errors naming what was expected, and leave the model
//! as it was; ranks that build different models are caught at construction, naming the
//! var, both shapes and both ranks. (A bad loss on one rank: `recover.rs`.)

use crate::models::*;
use crate::parity::{config, rows};
use candle::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, ShardingStrategy, StateDictType};
use fsdp_candle::{CandleFsdp, Wrap};

pub fn mlp_model(pg: Group, init: &VarMap) -> fsdp_candle::Result<CandleFsdp<Mlp>> {
    let wrap = Wrap::prefixes(["layers.0", "layers.1"]);
    CandleFsdp::from_varmap(mlp, init, &wrap, pg, config(ShardingStrategy::FullShard))
}

pub fn err<T>(r: fsdp_candle::Result<T>) -> String {
    match r {
        Ok(_) => "no error".into(),
        Err(e) => e.to_string(),
    }
}

pub fn has(s: &str, part: &str) {
    assert!(s.contains(part), "'{s}' does not contain '{part}'");
}

#[test]
fn calls_out_of_order_are_errors_and_change_nothing() {
    let init = init(mlp);
    let (_, want) = reference(&mlp_sgd(&init, 2));
    let dir = std::env::temp_dir().join(format!("fsdp-candle-guards-{}", std::process::id()));
    let out = launch(&LaunchOptions::new(2), |pg| {
        let (lo, hi) = rows(pg.rank(), 2);
        let mut m = mlp_model(pg, &init)?;
        let mut o = Opt::Sgd(0.1).fsdp();
        let mut e = vec![err(m.step(o.as_mut())), err(m.clip_grad_norm(1.0, 2.0))];
        m.save_checkpoint(&dir, None, StateDictType::Sharded, serde_json::Value::Null)?;
        for s in 0..2 {
            m.forward_backward(|model| mlp_loss(model, s, lo, hi))?;
            // A second backward before the step would add its gradients to the first's.
            e.push(err(m.forward_backward(|model| mlp_loss(model, s, lo, hi))));
            e.push(err(m.load_checkpoint(&dir, None)));
            m.step(o.as_mut())?;
        }
        e.push(err(m.step(o.as_mut())));
        Ok((e, values(&m.to_varmap()?)))
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    for (e, got) in &out {
        for i in [0, 1, 6] {
            has(
                &e[i],
                "no gradients since the last step: call forward_backward first",
            );
        }
        for i in [2, 4] {
            has(
                &e[i],
                "forward_backward: the gradients of 1 backward pass(es) wait for step()",
            );
            has(
                &e[i + 1],
                "load_checkpoint: gradients of the current values wait",
            );
        }
        // The refused calls changed nothing: two plain steps.
        for (name, v) in got {
            assert_close(name, v, &want[name], 1e-6);
        }
    }
}

#[test]
fn accumulated_micro_batches_equal_one_batch_and_eval_leaves_gradients_alone() {
    let init = init(mlp);
    let (_, want) = reference(&mlp_sgd(&init, 3));
    // The plain model's output on step 0's inputs, before any step.
    let plain = mlp(VarBuilder::from_varmap(
        &copy(&init),
        DType::F32,
        &Device::Cpu,
    ))
    .unwrap();
    let x = mlp_batch(0, 0, ROWS).0;
    let y0 = plain
        .forward(&x)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let out = launch(&LaunchOptions::new(2), |pg| {
        let (lo, hi) = rows(pg.rank(), 2);
        let mid = (lo + hi) / 2;
        let mut m = mlp_model(pg, &init)?;
        let mut o = Opt::Sgd(0.1).fsdp();
        let mut evals = Vec::new();
        for s in 0..3 {
            // Two micro-batches of half the rows, each loss halved: the mean of the two.
            for (a, b) in [(lo, mid), (mid, hi)] {
                m.forward_backward_accumulate(|model| mlp_loss(model, s, a, b)? * 0.5)?;
            }
            let e = m.eval(|model| model.forward(&x)?.flatten_all()?.to_vec1::<f32>())?;
            evals.push(e);
            m.step(o.as_mut())?;
        }
        Ok((evals, values(&m.to_varmap()?)))
    })
    .unwrap();
    for (evals, got) in &out {
        assert_close("eval before the first step", &evals[0], &y0, 1e-6);
        for (name, v) in got {
            assert_close(name, v, &want[name], 1e-6);
        }
    }
}

/// `a.w` of shape `(2, 3)`, or `(3, 2)` on rank 1 when `transposed`.
fn two_by_three(vb: VarBuilder, transposed: bool) -> candle::Result<Tensor> {
    let shape = match transposed && fsdp::distributed::get_rank().unwrap_or(0) == 1 {
        true => (3, 2),
        false => (2, 3),
    };
    vb.pp("a").get(shape, "w")
}

#[test]
fn bad_declarations_are_named() {
    let init = init(mlp);
    let out = launch(&LaunchOptions::new(2), |pg| {
        let wrap = Wrap::prefixes(["layers.0"]);
        let cfg = FsdpConfig::default();
        let build = |vm: &VarMap, wrap: &Wrap, cfg: FsdpConfig| {
            err(CandleFsdp::from_varmap(mlp, vm, wrap, pg.clone(), cfg))
        };
        let mut e = vec![
            build(&init, &Wrap::prefixes(["layers.9"]), cfg.clone()),
            build(
                &init,
                &wrap,
                FsdpConfig {
                    auto_wrap_policy: Some(fsdp::fsdp::size_based_auto_wrap_policy(1)),
                    ..cfg.clone()
                },
            ),
            build(
                &init,
                &wrap,
                FsdpConfig {
                    ignored_modules: vec!["layers.0".into()],
                    ..cfg.clone()
                },
            ),
        ];
        // Initial values that lack a var, or hold one the model never asks for.
        let partial = VarMap::new();
        partial.data().lock().unwrap().insert(
            "layers.0.weight".into(),
            init.data().lock().unwrap()["layers.0.weight"].clone(),
        );
        e.push(build(&partial, &wrap, cfg.clone()));
        let extra = copy(&init);
        extra
            .get(
                (2,),
                "stray.bias",
                candle_nn::Init::Const(0.0),
                DType::F32,
                &Device::Cpu,
            )
            .map_err(|e| fsdp::Error::Data(e.to_string()))?;
        e.push(build(&extra, &wrap, cfg.clone()));
        // Ranks that build different models.
        let model = |t: bool| move |vb: VarBuilder| two_by_three(vb, t);
        e.push(err(CandleFsdp::new(
            model(true),
            &Wrap::Root,
            pg.clone(),
            cfg.clone(),
        )));
        e.push(err(CandleFsdp::new(
            model(false),
            &Wrap::prefixes(["a"]),
            pg.clone(),
            cfg.clone(),
        )));
        Ok(e)
    })
    .unwrap();
    for e in &out {
        has(&e[0], "unit 'layers.9' holds no var: no var name starts with 'layers.9.' (the model's modules: layers.0, layers.1, layers.2)");
        has(
            &e[1],
            "FsdpConfig::auto_wrap_policy: the units come from the Wrap argument",
        );
        has(&e[2], "FsdpConfig::ignored_modules");
        has(
            &e[3],
            "var 'layers.0.bias' is asked for by the builder but is not in the VarMap given",
        );
        has(
            &e[4],
            "the VarMap holds var 'stray.bias', which the model builder never asks for",
        );
        has(
            &e[5],
            "rank 1 declares another model than rank 0: rank 1 built 'a.w' with shape [3, 2], rank 0 with shape [2, 3]",
        );
        assert_eq!(e[6], "no error");
    }
}
