//! `DistributedSampler` against PyTorch 2.11's (`tests/torch_ref/sampler_refs.json`, made by
//! `tests/torch_ref/make_sampler_refs.py`): every rank's indices, shuffled or not, padded or
//! with `drop_last`, sizes below and above the world size; and `global_mean_loss` over
//! thread ranks.

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::train::{global_mean_loss, DistributedSampler};
use serde_json::Value;

#[test]
fn indices_match_pytorch_on_every_rank() {
    let cases: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string("tests/torch_ref/sampler_refs.json").unwrap(),
    )
    .unwrap();
    assert!(cases.len() >= 10);
    for c in &cases {
        let n = c["n"].as_u64().unwrap() as usize;
        let w = c["world"].as_u64().unwrap() as usize;
        let shuffle = c["shuffle"].as_bool().unwrap();
        let drop_last = c["drop_last"].as_bool().unwrap();
        let seed = c["seed"].as_u64().unwrap();
        let epoch = c["epoch"].as_u64().unwrap();
        let ranks: Vec<Vec<usize>> = serde_json::from_value(c["ranks"].clone()).unwrap();
        for (r, want) in ranks.iter().enumerate() {
            let mut s = DistributedSampler::new(n, w, r, shuffle, seed, drop_last).unwrap();
            s.set_epoch(epoch);
            assert_eq!(&s.indices(), want, "{c}: rank {r}");
            assert_eq!(s.len(), want.len(), "{c}: len");
        }
        // Equal counts on every rank; without drop_last every index is drawn.
        assert!(ranks.iter().all(|r| r.len() == ranks[0].len()));
        if !drop_last && n > 0 {
            let mut seen: Vec<usize> = ranks.concat();
            seen.sort();
            seen.dedup();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }
    }
}

#[test]
fn epochs_reorder_and_bad_ranks_are_refused() {
    let mut s = DistributedSampler::new(50, 2, 1, true, 0, false).unwrap();
    let e0 = s.indices();
    s.set_epoch(1);
    assert_ne!(s.indices(), e0);
    s.set_epoch(0);
    assert_eq!(s.indices(), e0);
    let e = DistributedSampler::new(5, 2, 2, false, 0, false).unwrap_err();
    assert!(e.to_string().contains("invalid rank 2"), "{e}");
    let e = DistributedSampler::new(5, 0, 0, false, 0, false).unwrap_err();
    assert!(e.to_string().contains("num_replicas 0"), "{e}");
    // A world far larger than the dataset: each rank gets one (repeated) index, and
    // nothing of the size of the world is built.
    let s = DistributedSampler::new(10, usize::MAX / 2, 12, false, 0, false).unwrap();
    assert_eq!(s.indices(), vec![2]);
    let e = DistributedSampler::new(usize::MAX, usize::MAX / 2 + 1, 0, false, 0, false);
    assert!(e.unwrap_err().to_string().contains("overflows"));
    // Empty dataset: nothing anywhere.
    let s = DistributedSampler::new(0, 3, 0, true, 0, false).unwrap();
    assert!(s.is_empty() && s.indices().is_empty());
}

#[test]
fn global_mean_loss_weights_ranks_by_their_counts() {
    for w in [1usize, 2, 3] {
        let out = launch(&LaunchOptions::new(w), |pg| {
            let r = pg.rank();
            let equal = global_mean_loss(&pg, r as f32, 4)?;
            let weighted = global_mean_loss(&pg, (r + 1) as f32, r + 1)?;
            // A rank without samples does not pull the mean down.
            let some_empty = global_mean_loss(&pg, f32::NAN, if r == 0 { 2 } else { 0 });
            Ok((equal, weighted, some_empty.map_err(|e| e.to_string())))
        })
        .unwrap();
        let mean = (0..w).map(|r| r as f32).sum::<f32>() / w as f32;
        let sq: f32 = (1..=w).map(|k| (k * k) as f32).sum::<f32>();
        let cnt: f32 = (1..=w).map(|k| k as f32).sum::<f32>();
        for (equal, weighted, some_empty) in &out {
            assert_eq!(*equal, mean);
            assert_eq!(*weighted, sq / cnt);
            assert!(
                some_empty.as_ref().unwrap().is_nan(),
                "rank 0's NaN comes through"
            );
        }
    }
    let out = launch(&LaunchOptions::new(2), |pg| {
        Ok(global_mean_loss(&pg, 1.0, 0).map_err(|e| e.to_string()))
    })
    .unwrap();
    assert!(out[0]
        .as_ref()
        .unwrap_err()
        .contains("no rank has a sample"));
}
