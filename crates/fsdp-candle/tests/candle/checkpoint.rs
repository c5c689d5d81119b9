//! A checkpoint saved at world size 4 resumes at world size 2 (model and AdamW state):
//! continuing equals an uninterrupted run. A full checkpoint's model file, keyed by the
//! candle var names, loads into the plain candle model with `VarMap::load`.

use crate::models::*;
use crate::parity::{config, rows, sharded};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{ShardingStrategy, StateDictType};
use fsdp_candle::{CandleFsdp, Wrap};
use std::path::PathBuf;

const STEPS: usize = 20;
const SAVE_AT: usize = 10;

fn blocks() -> Wrap {
    Wrap::modules(|p| p.starts_with("blocks.") && p.split('.').count() == 2)
}

fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("fsdp-candle-{what}-{}", std::process::id()))
}

#[test]
fn a_checkpoint_saved_at_world_4_resumes_at_world_2() {
    let init = init(gpt);
    let opt = Opt::AdamW(3e-3);
    let (dir, full) = (scratch("ckpt"), scratch("full"));
    let wrap = blocks();
    let first = launch(&LaunchOptions::new(4), |pg| {
        let (lo, hi) = rows(pg.rank(), 4);
        let mut m =
            CandleFsdp::from_varmap(gpt, &init, &wrap, pg, config(ShardingStrategy::FullShard))?;
        let mut o = opt.fsdp();
        let mut losses = Vec::new();
        for s in 0..SAVE_AT {
            losses.push(m.forward_backward(|model| gpt_loss(model, s, lo, hi))?);
            m.step(o.as_mut())?;
        }
        m.save_checkpoint(
            &dir,
            Some(o.as_ref()),
            StateDictType::Sharded,
            serde_json::json!({ "step": SAVE_AT }),
        )?;
        Ok(losses)
    })
    .unwrap();
    // At world size 2 under another strategy, from candle's own (random) initial values:
    // everything comes from the checkpoint.
    let second = launch(&LaunchOptions::new(2), |pg| {
        let (lo, hi) = rows(pg.rank(), 2);
        let mut m = CandleFsdp::new(gpt, &wrap, pg, config(ShardingStrategy::ShardGradOp))?;
        let mut o = opt.fsdp();
        let info = m.load_checkpoint(&dir, Some(o.as_mut()))?;
        assert_eq!(
            (info.world_size, info.extra["step"].as_u64()),
            (4, Some(SAVE_AT as u64))
        );
        let mut losses = Vec::new();
        for s in SAVE_AT..STEPS {
            losses.push(m.forward_backward(|model| gpt_loss(model, s, lo, hi))?);
            m.step(o.as_mut())?;
        }
        m.save_checkpoint(&full, None, StateDictType::Full, serde_json::Value::Null)?;
        Ok((losses, values(&m.to_varmap()?)))
    })
    .unwrap();
    let run = Run {
        build: gpt,
        loss: gpt_loss,
        init: &init,
        opt,
        steps: STEPS,
    };
    let whole = sharded(&run, 2, &config(ShardingStrategy::ShardGradOp), &wrap);
    let mean =
        |l: &[Vec<f32>], s: usize| l.iter().map(|r| f64::from(r[s])).sum::<f64>() / l.len() as f64;
    let first: Vec<f32> = (0..SAVE_AT).map(|s| mean(&first, s) as f32).collect();
    let seconds: Vec<Vec<f32>> = second.iter().map(|(l, _)| l.clone()).collect();
    let second_l: Vec<f32> = (0..STEPS - SAVE_AT)
        .map(|s| mean(&seconds, s) as f32)
        .collect();
    assert_close("losses before the save", &first, &whole.0[..SAVE_AT], 1e-6);
    assert_close(
        "losses after the resume",
        &second_l,
        &whole.0[SAVE_AT..],
        1e-6,
    );
    for (name, v) in &second[0].1 {
        assert_close(name, v, &whole.1[name], 1e-6);
    }
    // The full checkpoint's model file: the trained values under the candle var names.
    let file = std::fs::read_dir(&full)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("model-")
        })
        .expect("a model-g<G>.safetensors file");
    let mut plain = crate::models::init(gpt);
    plain.load(&file).unwrap();
    assert_eq!(
        values(&plain),
        second[0].1,
        "the full checkpoint loaded by candle"
    );
    for d in [&dir, &full] {
        let _ = std::fs::remove_dir_all(d);
    }
}
