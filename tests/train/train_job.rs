//! The main job end to end: losses independent of world size, memory split by the world
//! size, metrics written, bad options refused before any compute; ZeRO-1
//! (`--zero-redundancy-optimizer`) with no-shard's losses and 1/W of its optimizer state.

use crate::common;

use fsdp::fsdp::ShardingStrategy;
use fsdp::train::{train, Silent, TrainConfig, TrainReport, WrapMode};

use common::{assert_close, corpus_file, no_shard_job, small_job as small};

fn run(cfg: &TrainConfig) -> TrainReport {
    train(cfg, &Silent).unwrap_or_else(|e| panic!("{cfg:?}: {e}"))
}

#[test]
fn per_step_losses_do_not_depend_on_world_size_or_strategy() {
    let data = corpus_file("parity");
    let base = run(&small(data.clone(), 1)).losses();
    assert_eq!(base.len(), 30);
    assert!(base[29] < base[0] - 1.0, "loss did not fall: {base:?}");
    let mut runs = vec![];
    for w in [2, 4] {
        runs.push((format!("full-shard ws {w}"), small(data.clone(), w)));
    }
    for s in [
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ] {
        runs.push((
            format!("{s:?} ws 4 (hybrid: 2 nodes x 2)"),
            TrainConfig {
                strategy: s,
                ranks_per_node: s.is_hybrid().then_some(2),
                ..small(data.clone(), 4)
            },
        ));
    }
    for wrap in [WrapMode::None, WrapMode::Size(3000)] {
        runs.push((
            format!("wrap {wrap} ws 4"),
            TrainConfig {
                wrap,
                ..small(data.clone(), 4)
            },
        ));
    }
    runs.push((
        "no FSDP ws 1".into(),
        TrainConfig {
            no_fsdp: true,
            ..small(data.clone(), 1)
        },
    ));
    for (name, cfg) in runs {
        let got = run(&cfg).losses();
        for (step, (g, b)) in got.iter().zip(&base).enumerate() {
            assert!(
                (g - b).abs() <= 1e-3 * b.abs(),
                "{name}: step {} loss {g} vs world size 1 {b}",
                step + 1
            );
        }
    }
}

#[test]
fn per_rank_state_at_world_size_4_is_a_quarter_of_world_size_1() {
    let data = corpus_file("memory");
    let metrics = data.with_file_name("metrics.jsonl");
    let one = run(&TrainConfig {
        steps: 2,
        n_layer: 4,
        ..small(data.clone(), 1)
    });
    let four = run(&TrainConfig {
        steps: 2,
        n_layer: 4,
        metrics: Some(metrics.clone()),
        ..small(data, 4)
    });
    let m1 = one.records[1].ranks[0];
    assert_eq!(four.records[1].ranks.len(), 4);
    for m4 in &four.records[1].ranks {
        let ratio = m4.sharded_total() as f64 / m1.sharded_total() as f64;
        // A quarter, plus at most 3 padding elements per unit; Adam keeps an 8-byte step
        // per optimizer entry (one per parameter piece on the rank), which a rank with
        // fewer pieces than a quarter of the parameters has less of.
        assert!(
            (0.2499..0.2502).contains(&ratio),
            "rank {}: {} / {} = {ratio}",
            m4.rank,
            m4.sharded_total(),
            m1.sharded_total()
        );
        // Per-block units: the root, the block computing and the one prefetched (backward
        // prefetch, limit_all_gathers) are gathered at a time, never the whole model.
        assert!(m4.peak_unsharded_param_bytes > 0);
        assert_eq!(m4.peak_unsharded_units, 3);
        assert!(
            m4.peak_unsharded_param_bytes < m1.param_shard_bytes,
            "{} vs {}",
            m4.peak_unsharded_param_bytes,
            m1.param_shard_bytes
        );
    }
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i + 1);
        assert!(l["loss"].as_f64().unwrap() > 0.0);
        assert!(l["tokens_per_s"].as_f64().unwrap() > 0.0);
        let ranks = l["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 4);
        for key in [
            "param_shard_bytes",
            "grad_shard_bytes",
            "optim_state_bytes",
            "peak_unsharded_param_bytes",
        ] {
            assert!(ranks[0][key].as_u64().unwrap() > 0, "{key}");
        }
    }
}

#[test]
fn eval_and_sample_come_from_the_trained_model() {
    let data = corpus_file("eval");
    let r = run(&TrainConfig {
        eval_every: 10,
        sample_len: 40,
        ..small(data, 2)
    });
    let evals = r.eval_losses();
    assert_eq!(
        evals.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![10, 20, 30]
    );
    assert!(evals[2].1 < evals[0].1, "{evals:?}");
    assert!(!r.sample.is_empty());
}

#[test]
fn bad_options_are_refused_before_any_compute() {
    let data = corpus_file("bad");
    let cases: Vec<(TrainConfig, &str)> = vec![
        (
            TrainConfig {
                global_batch: 6,
                ..small(data.clone(), 4)
            },
            "--global-batch 6 must be a positive multiple of --world-size 4",
        ),
        (
            TrainConfig {
                steps: 0,
                ..small(data.clone(), 1)
            },
            "--steps must be at least 1",
        ),
        (
            TrainConfig {
                n_head: 5,
                ..small(data.clone(), 1)
            },
            "divisible by --n-head 5",
        ),
        (
            TrainConfig {
                data: data.with_file_name("missing.txt"),
                ..small(data.clone(), 1)
            },
            "cannot read data file",
        ),
        (
            TrainConfig {
                strategy: ShardingStrategy::HybridShard,
                ranks_per_node: Some(3),
                ..small(data.clone(), 4)
            },
            "--ranks-per-node 3 must divide --world-size 4",
        ),
    ];
    for (cfg, want) in cases {
        let err = train(&cfg, &Silent).unwrap_err().to_string();
        assert!(err.contains(want), "expected '{want}' in '{err}'");
    }
}

#[test]
fn the_default_job_has_the_same_losses_at_world_sizes_1_2_4_over_30_steps() {
    // The main job's model and batch (4 layers x 128, 64 rows x 64 tokens, AdamW 2e-3) on
    // a synthetic corpus, so the test needs no download.
    let data = corpus_file("default");
    let cfg = |w| TrainConfig {
        data: data.clone(),
        world_size: w,
        steps: 30,
        eval_every: 0,
        eval_batches: 1,
        sample_len: 0,
        ..TrainConfig::default()
    };
    let base = run(&cfg(1)).losses();
    for w in [2, 4] {
        let got = run(&cfg(w)).losses();
        for (step, (g, b)) in got.iter().zip(&base).enumerate() {
            assert!(
                (g - b).abs() <= 1e-3 * b.abs(),
                "world size {w}: step {} loss {g} vs {b}",
                step + 1
            );
        }
    }
}

#[test]
fn learning_rate_warms_up_then_follows_half_a_cosine_to_a_tenth() {
    let cfg = TrainConfig {
        lr: 1e-2,
        steps: 121,
        warmup_steps: 20,
        lr_schedule: fsdp::train::LrSchedule::Cosine,
        ..TrainConfig::default()
    };
    assert!((cfg.lr_at(1) - 5e-4).abs() < 1e-9);
    assert!((cfg.lr_at(20) - 1e-2).abs() < 1e-9);
    assert!(
        (cfg.lr_at(21) - 1e-2).abs() < 1e-9,
        "full lr right after the warm-up"
    );
    assert!((cfg.lr_at(71) - 5.5e-3).abs() < 1e-7, "{}", cfg.lr_at(71));
    assert!((cfg.lr_at(121) - 1e-3).abs() < 1e-9);
    let constant = TrainConfig {
        lr_schedule: fsdp::train::LrSchedule::Constant,
        ..cfg
    };
    assert_eq!(constant.lr_at(21), 1e-2);
    assert_eq!(constant.lr_at(121), 1e-2);
}

#[test]
fn gradient_accumulation_with_and_without_no_sync_matches_one_big_batch() {
    let data = corpus_file("accum");
    let base = run(&TrainConfig {
        steps: 10,
        ..small(data.clone(), 2)
    })
    .losses();
    for no_sync in [false, true] {
        let cfg = TrainConfig {
            steps: 10,
            grad_accum: 4,
            no_sync,
            ..small(data.clone(), 2)
        };
        let got = run(&cfg).losses();
        for (step, (g, b)) in got.iter().zip(&base).enumerate() {
            assert!(
                (g - b).abs() <= 1e-3 * b.abs(),
                "no_sync {no_sync}: step {} loss {g} vs {b}",
                step + 1
            );
        }
    }
    let err = train(
        &TrainConfig {
            grad_accum: 3,
            ..small(data, 2)
        },
        &Silent,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("--grad-accum 3"), "{err}");
}

#[test]
fn clipping_reports_the_same_global_norm_at_every_world_size() {
    let data = corpus_file("clip");
    let cfg = |w| TrainConfig {
        steps: 8,
        clip_grad_norm: Some(0.5),
        ..small(data.clone(), w)
    };
    let one = run(&cfg(1));
    let norms1: Vec<f32> = one.records.iter().map(|r| r.grad_norm.unwrap()).collect();
    assert!(
        norms1.iter().any(|&n| n > 0.5),
        "clipping never engaged: {norms1:?}"
    );
    for w in [2, 4] {
        let r = run(&cfg(w));
        for (step, (rec, n1)) in r.records.iter().zip(&norms1).enumerate() {
            let n = rec.grad_norm.unwrap();
            assert!(
                (n - n1).abs() <= 1e-3 * n1,
                "world size {w} step {}: norm {n} vs {n1}",
                step + 1
            );
        }
        for (a, b) in r.losses().iter().zip(one.losses()) {
            assert!((a - b).abs() <= 1e-3 * b);
        }
    }
    // Clipping changes the trajectory (the test would notice if it did nothing).
    let unclipped = run(&TrainConfig {
        steps: 8,
        clip_grad_norm: None,
        ..small(data.clone(), 1)
    })
    .losses();
    assert!((unclipped[7] - one.losses()[7]).abs() > 1e-4);
}

#[test]
fn prefetch_flags_keep_the_losses_and_bf16_stays_close_to_f32() {
    use fsdp::fsdp::BackwardPrefetch;
    use fsdp::train::Precision;
    let data = corpus_file("prefetch");
    let short = |w| TrainConfig {
        steps: 10,
        ..small(data.clone(), w)
    };
    let base = run(&short(4)).losses();
    for (bwd, fwd, limit) in [
        (None, false, false),
        (Some(BackwardPrefetch::BackwardPost), true, false),
        (Some(BackwardPrefetch::BackwardPre), true, true),
    ] {
        let cfg = TrainConfig {
            backward_prefetch: bwd,
            forward_prefetch: fwd,
            limit_all_gathers: limit,
            // Offloading shards to host memory moves data, never changes it.
            cpu_offload: fwd,
            ..short(4)
        };
        // Prefetching changes when parameters are gathered, never a value.
        assert_eq!(run(&cfg).losses(), base, "{bwd:?} {fwd} {limit}");
    }
    for p in [Precision::Bf16, Precision::F16] {
        let cfg = TrainConfig {
            mixed_precision: p,
            // f16 trains with its grad scaler, from 2^15: the default 2^16 is beyond f16,
            // so its first step would be skipped (tests/fsdp/grad_scaler.rs), and the curve
            // would lag f32's by a step.
            init_scale: 32768.0,
            ..short(4)
        };
        let report = run(&cfg);
        assert!(report.records.iter().all(|r| !r.skipped), "{p:?}");
        let got = report.losses();
        assert_ne!(got, base, "{p:?} must change the numbers");
        for (step, (g, b)) in got.iter().zip(&base).enumerate() {
            assert!((g - b).abs() <= 2e-2 * b, "{p:?} step {step}: {g} vs {b}");
        }
    }
}

/// Child-process entry: prints what `LaunchOptions::from_env_or(2)`, the examples' way to
/// read `WORLD_SIZE`, made of the variable. A no-op in a normal test run.
#[test]
fn world_size_env_child_entry() {
    if std::env::var_os("FSDP_TEST_WORLD_SIZE_CHILD").is_none() {
        return;
    }
    match fsdp::distributed::LaunchOptions::from_env_or(2) {
        Ok(o) => println!("CHILD ok {}", o.world_size),
        Err(e) => println!("CHILD error: {e}"),
    }
}

/// The examples read `WORLD_SIZE` through `LaunchOptions::from_env_or`; a million thread
/// ranks is refused there, naming the variable and the limit, as `fsdp train
/// --world-size` refuses it (one shared check).
#[test]
fn world_size_beyond_the_machine_is_refused_for_examples_and_train() {
    let child = |ws: &str| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &common::test_name(module_path!(), "world_size_env_child_entry"),
            ])
            .arg("--nocapture")
            .env("FSDP_TEST_WORLD_SIZE_CHILD", "1")
            .env("WORLD_SIZE", ws)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        stdout
            .lines()
            .find(|l| l.starts_with("CHILD"))
            .unwrap_or_else(|| panic!("no CHILD line: {stdout}"))
            .to_string()
    };
    assert_eq!(child("3"), "CHILD ok 3");
    let err = child("1000000");
    assert!(
        err.contains("WORLD_SIZE=1000000") && err.contains("at most"),
        "{err}"
    );
    let shared = fsdp::distributed::check_thread_ranks(1_000_000, "--world-size")
        .unwrap_err()
        .to_string();
    assert!(shared.contains("--world-size 1000000"), "{shared}");
    fsdp::distributed::check_thread_ranks(4, "--world-size").unwrap();
    let data = corpus_file("huge-world");
    let err = train(
        &TrainConfig {
            global_batch: 1_000_000,
            ..small(data, 1_000_000)
        },
        &Silent,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("--world-size"), "{err}");
}

#[test]
fn fsdp_train_with_zero1_gives_no_shards_losses_with_1_over_w_of_its_optimizer_state() {
    let data = corpus_file("zero1-train");
    for world in 1..=4 {
        let plain = train(&no_shard_job(&data, world, false), &Silent).unwrap();
        let zero = train(&no_shard_job(&data, world, true), &Silent).unwrap();
        assert_close(
            &format!("world {world} losses"),
            &zero.losses(),
            &plain.losses(),
            0.0,
            0.0,
        );
        let (z, p) = (&zero.records[9].ranks, &plain.records[9].ranks);
        let ratio = z[0].optim_state_bytes as f64 / p[0].optim_state_bytes as f64;
        println!(
            "world {world}: optim_state_bytes rank 0 {} vs no-shard {} ({ratio:.4}), grad_shard_bytes {} vs {}",
            z[0].optim_state_bytes, p[0].optim_state_bytes, z[0].grad_shard_bytes, p[0].grad_shard_bytes
        );
        assert!(
            (ratio - 1.0 / world as f64).abs() < 0.01,
            "world {world}: {ratio}"
        );
        // Split, not copied: AdamW's moments of every element on one rank, plus an 8-byte
        // step per list entry (a parameter straddling two chunks is one on each rank:
        // at most W - 1 more per unit, and the job has n_layer + 1 units).
        let total: usize = z.iter().map(|r| r.optim_state_bytes).sum();
        let extra = total - p[0].optim_state_bytes;
        assert!(
            extra % 8 == 0 && extra <= 8 * (world - 1) * 3,
            "world {world}: {extra}"
        );
        let grads = z[0].grad_shard_bytes as f64 / p[0].grad_shard_bytes as f64;
        assert!(
            (grads - 1.0 / world as f64).abs() < 0.01,
            "world {world}: {grads}"
        );
        assert_eq!(z[0].param_shard_bytes, p[0].param_shard_bytes);
    }
}

#[test]
fn train_options_refuse_zero1_with_a_sharded_strategy_or_without_fsdp() {
    let data = corpus_file("zero1-options");
    let bad = TrainConfig {
        strategy: ShardingStrategy::FullShard,
        ..no_shard_job(&data, 2, true)
    };
    let e = bad.validate().unwrap_err().to_string();
    assert!(
        e.contains("--zero-redundancy-optimizer") && e.contains("--strategy full-shard"),
        "{e}"
    );
    let bad = TrainConfig {
        no_fsdp: true,
        ..no_shard_job(&data, 1, true)
    };
    let e = bad.validate().unwrap_err().to_string();
    assert!(
        e.contains("--zero-redundancy-optimizer") && e.contains("--no-fsdp"),
        "{e}"
    );
}
