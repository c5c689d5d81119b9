//! `fsdp plot METRICS.jsonl... --out FILE.svg`: loss, eval loss and tokens/s against step
//! for one or several runs (world sizes, strategies, a resumed run over its original), as
//! one SVG with a panel per quantity and a polyline per run; `fsdp train --plot FILE`
//! draws its own run at the end.
//!
//! The SVG is written here, without a plotting crate: a few hundred lines of text, no font
//! or system library, the same bytes on every machine. Each curve is a `<polyline>` with
//! `data-run` (the run's label) and `data-metric` (`loss`, `eval_loss`, `tokens_per_s`), so
//! tools and tests can read the points back.

use clap::Args;
use fsdp::{Error, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `fsdp plot` options.
#[derive(Args)]
pub(crate) struct PlotArgs {
    /// Metrics files written by `fsdp train --metrics` (one JSON object per step); each is
    /// one run on the plot.
    #[arg(required = true, num_args = 1..)]
    metrics: Vec<PathBuf>,
    /// The SVG file to write.
    #[arg(long, short, default_value = "metrics.svg")]
    out: PathBuf,
    /// A name for each run in the legend, in the order of the files (default: each file's
    /// name without its extension).
    #[arg(long = "label")]
    labels: Vec<String>,
}

/// One step of a run: what the plot reads of a `StepRecord`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Point {
    pub step: u64,
    pub loss: f64,
    pub tokens_per_s: f64,
    pub eval_loss: Option<f64>,
}

/// A run: its legend label and its steps in file order.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    pub label: String,
    pub points: Vec<Point>,
}

/// `fsdp plot`.
pub(crate) fn run_plot(a: PlotArgs) -> Result<()> {
    if !a.labels.is_empty() && a.labels.len() != a.metrics.len() {
        return Err(Error::InvalidArgument(format!(
            "{} --label values for {} metrics files; give one per file or none",
            a.labels.len(),
            a.metrics.len()
        )));
    }
    check_out(&a.out)?;
    check_not_an_input(&a.out, &a.metrics)?;
    let mut runs = Vec::with_capacity(a.metrics.len());
    for (i, path) in a.metrics.iter().enumerate() {
        let label = a.labels.get(i).cloned().unwrap_or_else(|| stem(path));
        runs.push(read_run(path, label)?);
    }
    write_svg(&a.out, &runs)?;
    let points: usize = runs.iter().map(|r| r.points.len()).sum();
    println!(
        "wrote {} ({} run{}, {points} steps)",
        a.out.display(),
        runs.len(),
        if runs.len() == 1 { "" } else { "s" }
    );
    Ok(())
}

/// The file name of `path` without its extension.
fn stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// Reads the metrics file `path`: every non-blank line one step record with a numeric
/// `step`, `loss` and `tokens_per_s` and an optional `eval_loss`.
///
/// # Errors
/// `Data` naming the file (and the line, counting from 1) when it cannot be read, a line is
/// not such a record, or it holds no record.
pub(crate) fn read_run(path: &Path, label: String) -> Result<Run> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::Data(format!(
            "cannot read metrics file '{}': {e}",
            path.display()
        ))
    })?;
    let mut points = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: String| {
            Error::Data(format!(
                "metrics file '{}' line {}: {what}; each line must be one JSON object per step, as `fsdp train --metrics` writes",
                path.display(),
                i + 1
            ))
        };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(not_json(&e)))?;
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        let step = v
            .get("step")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| bad("no integer 'step'".into()))?;
        let loss = num("loss").ok_or_else(|| bad("no numeric 'loss'".into()))?;
        let tokens_per_s =
            num("tokens_per_s").ok_or_else(|| bad("no numeric 'tokens_per_s'".into()))?;
        let eval_loss = match v.get("eval_loss") {
            None | Some(serde_json::Value::Null) => None,
            Some(e) => Some(
                e.as_f64()
                    .ok_or_else(|| bad("'eval_loss' is not a number".into()))?,
            ),
        };
        points.push(Point {
            step,
            loss,
            tokens_per_s,
            eval_loss,
        });
    }
    if points.is_empty() {
        return Err(Error::Data(format!(
            "metrics file '{}' holds no step records",
            path.display()
        )));
    }
    Ok(Run { label, points })
}

/// Colors of the runs, in order (then repeated).
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

const WIDTH: f64 = 900.0;
const PANEL_H: f64 = 250.0;
const TOP: f64 = 40.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const PANEL_GAP: f64 = 50.0;

/// One panel: its title and the quantity of each point.
struct Panel {
    title: &'static str,
    metric: &'static str,
    value: fn(&Point) -> Option<f64>,
}

const PANELS: [Panel; 3] = [
    Panel {
        title: "training loss",
        metric: "loss",
        value: |p| Some(p.loss),
    },
    Panel {
        title: "eval loss",
        metric: "eval_loss",
        value: |p| p.eval_loss,
    },
    Panel {
        title: "tokens/s",
        metric: "tokens_per_s",
        value: |p| Some(p.tokens_per_s),
    },
];

/// Checks that `out` names an SVG file.
///
/// # Errors
/// `InvalidArgument` for an extension other than `.svg` (PNG is not written).
pub(crate) fn check_out(out: &Path) -> Result<()> {
    let ext = out
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    if ext.as_deref() != Some("svg") {
        return Err(Error::InvalidArgument(format!(
            "plot file '{}': only SVG is written; give a name ending in .svg",
            out.display()
        )));
    }
    // Checked before a run starts, so a typo does not cost the whole training.
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "plot file '{}': the folder '{}' does not exist",
            out.display(),
            dir.display()
        )));
    }
    Ok(())
}

/// `out` must not be one of the metrics files it is drawn from (writing it would destroy
/// them): compared by path after resolving links, when both exist.
fn check_not_an_input(out: &Path, inputs: &[std::path::PathBuf]) -> Result<()> {
    let Ok(o) = out.canonicalize() else {
        return Ok(());
    };
    for i in inputs {
        if i.canonicalize().is_ok_and(|c| c == o) {
            return Err(Error::InvalidArgument(format!(
                "plot file '{}' is the metrics file '{}' it would be drawn from; give another --out",
                out.display(),
                i.display()
            )));
        }
    }
    Ok(())
}

/// Writes the SVG of `runs` to `out`.
///
/// # Errors
/// `Io` naming the file when it cannot be written; `InvalidArgument` for an extension
/// other than `.svg`.
pub(crate) fn write_svg(out: &Path, runs: &[Run]) -> Result<()> {
    check_out(out)?;
    std::fs::write(out, render(runs))
        .map_err(|e| Error::io(format!("writing plot '{}'", out.display()), e))
}

/// The SVG document: a legend, then one panel per quantity with axes, ticks, grid and a
/// polyline per run (points of an eval loss also get a dot each: there are few).
pub(crate) fn render(runs: &[Run]) -> String {
    let height = TOP + PANELS.len() as f64 * (PANEL_H + PANEL_GAP) + 10.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    // Legend.
    let mut x = LEFT;
    for (i, r) in runs.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="20" x2="{}" y2="20" stroke="{c}" stroke-width="2"/><text x="{}" y="24">{}</text>"#,
            x + 20.0,
            x + 25.0,
            escape(&r.label)
        );
        x += 50.0 + 7.0 * r.label.chars().count() as f64;
    }
    let (smin, smax) = step_range(runs);
    for (k, panel) in PANELS.iter().enumerate() {
        let top = TOP + k as f64 * (PANEL_H + PANEL_GAP) + 20.0;
        let values: Vec<f64> = runs
            .iter()
            .flat_map(|r| r.points.iter().filter_map(panel.value))
            .filter(|v| v.is_finite())
            .collect();
        let _ = writeln!(
            s,
            r#"<text x="{LEFT}" y="{}" font-weight="bold">{}</text>"#,
            top - 6.0,
            panel.title
        );
        if values.is_empty() {
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" fill="gray">no {} in these runs</text>"#,
                LEFT + 10.0,
                top + PANEL_H / 2.0,
                panel.title
            );
            continue;
        }
        let (vmin, vmax) = padded(&values);
        let area = Area {
            x0: LEFT,
            x1: WIDTH - RIGHT,
            y0: top,
            y1: top + PANEL_H,
            smin,
            smax,
            vmin,
            vmax,
        };
        area.axes(&mut s);
        for (i, r) in runs.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            let pts: Vec<(f64, f64)> = r
                .points
                .iter()
                .filter_map(|p| Some((p.step as f64, (panel.value)(p)?)))
                .filter(|(_, v)| v.is_finite())
                .map(|(st, v)| area.at(st, v))
                .collect();
            let list: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.2},{y:.2}")).collect();
            let _ = writeln!(
                s,
                r#"<polyline data-run="{}" data-metric="{}" fill="none" stroke="{c}" stroke-width="1.5" points="{}"/>"#,
                escape(&r.label),
                panel.metric,
                list.join(" ")
            );
            if panel.metric == "eval_loss" {
                for (x, y) in &pts {
                    let _ = writeln!(s, r#"<circle cx="{x:.2}" cy="{y:.2}" r="3" fill="{c}"/>"#);
                }
            }
        }
    }
    s.push_str("</svg>\n");
    s
}

/// Where a panel draws: its pixel box and the data ranges it maps onto it.
struct Area {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    smin: f64,
    smax: f64,
    vmin: f64,
    vmax: f64,
}

impl Area {
    /// The pixel position of `(step, value)`.
    fn at(&self, step: f64, v: f64) -> (f64, f64) {
        let fx = (step - self.smin) / (self.smax - self.smin);
        let fy = (v - self.vmin) / (self.vmax - self.vmin);
        (
            self.x0 + fx * (self.x1 - self.x0),
            self.y1 - fy * (self.y1 - self.y0),
        )
    }

    /// The frame, the grid and the tick labels of both axes ("step" below).
    fn axes(&self, s: &mut String) {
        let _ = writeln!(
            s,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
            self.x0,
            self.y0,
            self.x1 - self.x0,
            self.y1 - self.y0
        );
        for t in ticks(self.smin, self.smax) {
            let (x, _) = self.at(t, self.vmin);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.2}" y1="{}" x2="{x:.2}" y2="{}" stroke="#ddd"/><text x="{x:.2}" y="{}" text-anchor="middle">{}</text>"##,
                self.y0,
                self.y1,
                self.y1 + 15.0,
                label(t)
            );
        }
        for t in ticks(self.vmin, self.vmax) {
            let (_, y) = self.at(self.smin, t);
            let _ = writeln!(
                s,
                r##"<line x1="{}" y1="{y:.2}" x2="{}" y2="{y:.2}" stroke="#ddd"/><text x="{}" y="{:.2}" text-anchor="end">{}</text>"##,
                self.x0,
                self.x1,
                self.x0 - 5.0,
                y + 4.0,
                label(t)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">step</text>"#,
            (self.x0 + self.x1) / 2.0,
            self.y1 + 32.0
        );
    }
}

/// The steps covered by all runs, widened to a non-empty range.
fn step_range(runs: &[Run]) -> (f64, f64) {
    let steps = runs
        .iter()
        .flat_map(|r| r.points.iter().map(|p| p.step as f64));
    let (lo, hi) = steps.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), s| {
        (a.min(s), b.max(s))
    });
    if hi > lo {
        (lo, hi)
    } else {
        (lo - 1.0, lo + 1.0)
    }
}

/// `[min, max]` of `values` with 5% room on each side (a unit around a single value).
fn padded(values: &[f64]) -> (f64, f64) {
    let (lo, hi) = values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let pad = if hi > lo {
        0.05 * (hi - lo)
    } else {
        0.5 * lo.abs().max(1.0)
    };
    (lo - pad, hi + pad)
}

/// About five round tick values (1, 2 or 5 times a power of ten apart) inside `[lo, hi]`.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let raw = (hi - lo) / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 && out.len() < 50 {
        out.push(t);
        t += step;
    }
    out
}

/// A tick label: integers without decimals, large values with a k/M suffix.
fn label(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if a >= 1e4 {
        format!("{}k", trim(v / 1e3))
    } else {
        trim(v)
    }
}

/// `v` with at most 4 significant decimals and no trailing zeros.
fn trim(v: f64) -> String {
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.into()
    }
}

/// `text` with XML's special characters escaped.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// What a line that does not parse as JSON is, without serde's line number (always 1: the
/// file's line is named already): `not JSON at column 2: expected ident`.
fn not_json(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let what = text
        .rsplit_once(" at line ")
        .map_or(text.as_str(), |(what, _)| what);
    format!("not JSON at column {}: {what}", e.column())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_inside() {
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(1.93, 3.41);
        assert_eq!(t.first().copied(), Some(2.0));
        assert!(t.iter().all(|&v| (1.93..=3.41).contains(&v)));
        assert_eq!(label(25_000.0), "25k");
        assert_eq!(label(2.5), "2.5");
        assert_eq!(label(1.5e6), "1.5M");
    }

    #[test]
    fn points_map_into_the_panel() {
        let a = Area {
            x0: 10.0,
            x1: 110.0,
            y0: 0.0,
            y1: 50.0,
            smin: 1.0,
            smax: 11.0,
            vmin: 0.0,
            vmax: 5.0,
        };
        assert_eq!(a.at(1.0, 0.0), (10.0, 50.0));
        assert_eq!(a.at(11.0, 5.0), (110.0, 0.0));
        assert_eq!(escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
