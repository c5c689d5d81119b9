//! What the `fsdp launch` and network-namespace tests share: a small training job, its
//! corpus, and the processes a job left running.

use std::path::Path;

/// A small job: one layer, 32 wide, 8 rows of 16 tokens; well under a second per run.
pub fn small_job(data: &str, steps: usize) -> Vec<String> {
    let steps = steps.to_string();
    [
        "train",
        "--data",
        data,
        "--steps",
        &steps,
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--global-batch",
        "8",
        "--seq-len",
        "16",
        "--eval-every",
        "0",
        "--sample-len",
        "0",
        "--log-every",
        "1",
        "--warmup-steps",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A 20,000-byte corpus in `dir`; its path.
pub fn corpus(dir: &Path) -> String {
    let p = dir.join("corpus.txt");
    std::fs::write(&p, super::common::corpus(20_000)).unwrap();
    p.to_str().unwrap().to_string()
}

/// Processes whose command line holds `token`.
pub fn processes_with(token: &str) -> usize {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
                .filter(|c| String::from_utf8_lossy(c).contains(token))
                .count()
        })
        .unwrap_or(0)
}
