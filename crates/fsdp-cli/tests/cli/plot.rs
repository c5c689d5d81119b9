//! `fsdp plot` and `fsdp train --plot`: the SVG exists and holds, for each run, a polyline
//! per quantity with one point per record (eval loss: per evaluation), in step order; a bad
//! metrics file is one line naming the file and the line.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn fsdp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-plot-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A metrics file of `steps` records: loss falling from `start`, 1000 + 10 step tokens/s,
/// an eval loss every `eval_every` steps.
fn metrics(path: &Path, steps: usize, start: f64, eval_every: usize) {
    let mut text = String::new();
    for s in 1..=steps {
        let mut rec = serde_json::json!({
            "step": s,
            "loss": start / s as f64,
            "tokens_per_s": 1000.0 + 10.0 * s as f64,
            "step_time_s": 0.1,
            "ranks": [],
        });
        if s % eval_every == 0 {
            rec["eval_loss"] = serde_json::json!(start / s as f64 + 0.5);
        }
        text.push_str(&rec.to_string());
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

/// The points of the polyline of `run` and `metric` in `svg`, as `(x, y)` pixels.
fn polyline(svg: &str, run: &str, metric: &str) -> Vec<(f64, f64)> {
    let key = format!(r#"data-run="{run}" data-metric="{metric}""#);
    let line = svg
        .lines()
        .find(|l| l.contains(&key))
        .unwrap_or_else(|| panic!("no polyline {key}"));
    let pts = line.split(r#"points=""#).nth(1).unwrap();
    let pts = &pts[..pts.find('"').unwrap()];
    pts.split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').unwrap();
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "failed: {o}\n{e}");
    o.into_owned()
}

#[test]
fn one_and_several_runs_are_drawn_with_every_point() {
    let d = dir("runs");
    let (a, b) = (d.join("world1.jsonl"), d.join("world2.jsonl"));
    metrics(&a, 30, 3.0, 10);
    metrics(&b, 20, 4.0, 5);
    // One run.
    let one = d.join("one.svg");
    let out = run_ok(
        fsdp()
            .args(["plot", a.to_str().unwrap(), "--out"])
            .arg(&one),
    );
    assert!(out.contains("1 run, 30 steps"), "{out}");
    let svg = std::fs::read_to_string(&one).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    let loss = polyline(&svg, "world1", "loss");
    assert_eq!(loss.len(), 30);
    assert!(
        loss.windows(2).all(|w| w[1].0 > w[0].0),
        "x grows with the step"
    );
    // The loss falls, so y (pixels, downwards) grows.
    assert!(loss.windows(2).all(|w| w[1].1 > w[0].1));
    assert_eq!(polyline(&svg, "world1", "eval_loss").len(), 3);
    assert_eq!(polyline(&svg, "world1", "tokens_per_s").len(), 30);
    // Two runs overlaid, with labels.
    let two = d.join("two.svg");
    let out = run_ok(
        fsdp()
            .args(["plot", a.to_str().unwrap(), b.to_str().unwrap()])
            .args(["--label", "W=1", "--label", "W=2 <resumed>", "-o"])
            .arg(&two),
    );
    assert!(out.contains("2 runs, 50 steps"), "{out}");
    let svg = std::fs::read_to_string(&two).unwrap();
    assert_eq!(polyline(&svg, "W=1", "loss").len(), 30);
    assert_eq!(polyline(&svg, "W=2 &lt;resumed&gt;", "loss").len(), 20);
    assert_eq!(polyline(&svg, "W=2 &lt;resumed&gt;", "eval_loss").len(), 4);
    // Same step axis: step 20 of both runs at the same x.
    let (l1, l2) = (
        polyline(&svg, "W=1", "loss"),
        polyline(&svg, "W=2 &lt;resumed&gt;", "loss"),
    );
    assert_eq!(l1[19].0, l2[19].0);
    assert!(svg.contains(">W=1</text>"));
}

/// Runs `fsdp ARGS`, expects failure with a single stderr line containing every `want`.
fn fails_with(args: &[&str], want: &[&str]) {
    let out = fsdp().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    for w in want {
        assert!(err.contains(w), "{args:?}: expected '{w}' in: {err}");
    }
}

#[test]
fn a_bad_metrics_file_is_one_line_naming_file_and_line() {
    let d = dir("bad");
    let good = d.join("good.jsonl");
    metrics(&good, 3, 2.0, 100);
    let g = good.to_str().unwrap();
    let out_svg = d.join("x.svg");
    let o = out_svg.to_str().unwrap();
    let cases: [(&str, &str, &str); 4] = [
        (
            "garbage.jsonl",
            "{\"step\":1,\"loss\":2,\"tokens_per_s\":5}\nnot json\n",
            "line 2: not JSON",
        ),
        (
            "noloss.jsonl",
            "{\"step\":1,\"tokens_per_s\":5}\n",
            "line 1: no numeric 'loss'",
        ),
        (
            "nostep.jsonl",
            "\n{\"loss\":1,\"tokens_per_s\":5}\n",
            "line 2: no integer 'step'",
        ),
        ("empty.jsonl", "\n\n", "holds no step records"),
    ];
    for (name, text, want) in cases {
        let p = d.join(name);
        std::fs::write(&p, text).unwrap();
        fails_with(&["plot", g, p.to_str().unwrap(), "--out", o], &[name, want]);
    }
    // The whole line: one pair of parentheses at most, serde's reason kept.
    let p = d.join("garbage.jsonl");
    let out = fsdp()
        .args(["plot", p.to_str().unwrap(), "--out", o])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "error: data: metrics file '{}' line 2: not JSON at column 2: expected ident; each line must be one JSON object per step, as `fsdp train --metrics` writes\n",
            p.display()
        )
    );
    let missing = d.join("missing.jsonl");
    fails_with(
        &["plot", missing.to_str().unwrap(), "--out", o],
        &["cannot read metrics file", "missing.jsonl"],
    );
    fails_with(&["plot", g, "--out", "x.png"], &["only SVG"]);
    // A plot into a folder that does not exist, or over one of its own inputs.
    let nowhere = d.join("no-such-dir").join("x.svg");
    fails_with(
        &["plot", g, "--out", nowhere.to_str().unwrap()],
        &["does not exist", "no-such-dir"],
    );
    let svg_named = d.join("run.svg");
    std::fs::copy(&good, &svg_named).unwrap();
    let s = svg_named.to_str().unwrap();
    fails_with(&["plot", s, "--out", s], &["is the metrics file"]);
    assert_eq!(
        std::fs::read(&svg_named).unwrap(),
        std::fs::read(&good).unwrap(),
        "the input survives"
    );
    fails_with(
        &["plot", g, "--label", "a", "--label", "b", "--out", o],
        &["2 --label values for 1"],
    );
    assert!(!out_svg.exists(), "nothing written on error");
}

#[test]
fn train_writes_its_plot_at_the_end() {
    let d = dir("train");
    let data = d.join("data.txt");
    std::fs::write(&data, common::corpus(5_000)).unwrap();
    let (m, p) = (d.join("m.jsonl"), d.join("run.svg"));
    run_ok(
        fsdp()
            .args([
                "train",
                "--world-size",
                "2",
                "--steps",
                "6",
                "--eval-every",
                "3",
            ])
            .args([
                "--seq-len",
                "16",
                "--n-layer",
                "1",
                "--n-embd",
                "16",
                "--n-head",
                "2",
            ])
            .args([
                "--global-batch",
                "4",
                "--sample-len",
                "0",
                "--warmup-steps",
                "2",
            ])
            .arg("--data")
            .arg(&data)
            .arg("--metrics")
            .arg(&m)
            .arg("--plot")
            .arg(&p),
    );
    let svg = std::fs::read_to_string(&p).unwrap();
    assert_eq!(polyline(&svg, "train", "loss").len(), 6);
    assert_eq!(polyline(&svg, "train", "eval_loss").len(), 2);
    // Without --metrics: from the run's own records.
    let p2 = d.join("run2.svg");
    run_ok(
        fsdp()
            .args([
                "train",
                "--world-size",
                "1",
                "--steps",
                "4",
                "--eval-every",
                "0",
            ])
            .args([
                "--seq-len",
                "16",
                "--n-layer",
                "1",
                "--n-embd",
                "16",
                "--n-head",
                "2",
            ])
            .args(["--global-batch", "4", "--sample-len", "0"])
            .arg("--data")
            .arg(&data)
            .arg("--plot")
            .arg(&p2),
    );
    let svg = std::fs::read_to_string(&p2).unwrap();
    assert_eq!(polyline(&svg, "train", "loss").len(), 4);
    // Eval only at the end.
    assert_eq!(polyline(&svg, "train", "eval_loss").len(), 1);
    // A bad plot name is refused before training.
    fails_with(
        &[
            "train",
            "--plot",
            "out.png",
            "--data",
            data.to_str().unwrap(),
        ],
        &["only SVG"],
    );
    let nowhere = d.join("no-such-dir").join("x.svg");
    fails_with(
        &[
            "train",
            "--plot",
            nowhere.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
        ],
        &["does not exist"],
    );
    let same = d.join("same.svg");
    let same = same.to_str().unwrap();
    fails_with(
        &[
            "train",
            "--plot",
            same,
            "--metrics",
            same,
            "--data",
            data.to_str().unwrap(),
        ],
        &["also the --metrics file"],
    );
}
