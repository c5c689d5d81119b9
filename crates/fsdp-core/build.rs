//! Compiles the workspace's kernels/*.cu with nvcc when the `cuda` feature is on, and
//! embeds the results (see src/kernels.rs). A build without the feature needs no CUDA at
//! all. Paths below (`kernels/`, `.cuda/`) are the workspace root's, two levels above this
//! crate.
//!
//! - nvcc is looked up in `NVCC`, then `CUDA_HOME/bin`, `CUDA_PATH/bin`, then `PATH`, then
//!   the location `scripts/install_nvcc.sh` installs to (`.cuda/nvidia/cu13/bin/nvcc`).
//!   Never probes nvidia-smi.
//! - Each `kernels/X.cu` becomes one fat binary `X.fatbin` holding a cubin per target
//!   architecture and the PTX of the lowest one, so the driver loads the cubin that matches
//!   the GPU and JIT-compiles the PTX for any newer one. Default targets: cubins for sm_80
//!   (A100) and sm_90 (H100/H200), PTX for compute_80. `CUDA_COMPUTE_CAP` overrides the
//!   list: `90` or `80,90` (cubins for each, PTX for the lowest).
//! - rerun-if-changed on every `.cu` and `.cuh` (a header counts as much as a source) and
//!   on the environment variables above.
//! - `--fmad=false`: kernels round like the CPU reference (see `compile_one`).
//! - nvcc failure prints the full command and nvcc's output, and fails the build.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEFAULT_CAPS: &[u32] = &[80, 90];

/// `fsdp_avx512`: the compiler has stable AVX-512 intrinsics (rustc 1.89 or later), which
/// the CPU row kernels and attention products (`backend::cpu::wide`, `head_gemm`) use;
/// older compilers (the crate's MSRV is 1.85) build without them and run the portable
/// loops, with the same results.
fn avx512_intrinsics_cfg() {
    println!("cargo::rustc-check-cfg=cfg(fsdp_avx512)");
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let minor = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| {
            // "rustc 1.95.0 (...)"
            let ver = v.split_whitespace().nth(1)?.to_string();
            let mut parts = ver.split('.');
            let major: u32 = parts.next()?.parse().ok()?;
            let minor: u32 = parts.next()?.parse().ok()?;
            (major == 1).then_some(minor)
        });
    if minor.is_some_and(|m| m >= 89) {
        println!("cargo:rustc-cfg=fsdp_avx512");
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    avx512_intrinsics_cfg();
    let kernels = workspace_root().join("kernels");
    println!("cargo:rerun-if-changed={}", kernels.display());
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "CUDA_COMPUTE_CAP", "PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let kernels_dir = kernels.as_path();
    let mut sources: Vec<PathBuf> = Vec::new();
    if let Ok(rd) = fs::read_dir(kernels_dir) {
        for e in rd.flatten() {
            let p = e.path();
            let ext = p.extension().and_then(|s| s.to_str()).unwrap_or("");
            if ext == "cu" || ext == "cuh" {
                println!("cargo:rerun-if-changed={}", p.display());
                if ext == "cu" {
                    sources.push(p);
                }
            }
        }
    }
    sources.sort();
    let built = if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        // No kernels: an empty table, so src/kernels.rs reads one table in every build.
        write_table("", &[])
    } else {
        build_kernels(kernels_dir, &sources)
    };
    if let Err(msg) = built {
        eprintln!("{msg}");
        std::process::exit(1);
    }
}

fn build_kernels(kernels_dir: &Path, sources: &[PathBuf]) -> Result<(), String> {
    let nvcc = find_nvcc().ok_or_else(|| {
        "error: the `cuda` feature compiles kernels/*.cu with nvcc, and no nvcc was found \
         (looked in NVCC, CUDA_HOME/bin, CUDA_PATH/bin, PATH and .cuda/nvidia/cu13/bin).\n\
         Install one with `scripts/install_nvcc.sh` (CUDA 13.0 from PyPI, no root needed; it \
         prints nvcc's path, pass it as NVCC=...), or build without `--features cuda`."
            .to_string()
    })?;
    let caps = compute_caps()?;
    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| format!("OUT_DIR: {e}"))?);
    // One nvcc per file, files in parallel (each nvcc is single-threaded per target).
    let results: Vec<Result<(String, PathBuf), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .map(|src| {
                let (nvcc, caps, out_dir) = (&nvcc, &caps, &out_dir);
                s.spawn(move || compile_one(nvcc, kernels_dir, src, caps, out_dir))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("nvcc worker thread panicked".into()))
            })
            .collect()
    });
    let fatbins = results.into_iter().collect::<Result<Vec<_>, String>>()?;
    write_table(&targets_string(&caps), &fatbins)
}

/// Writes `$OUT_DIR/kernels_fatbin.rs`: `TARGETS`, and `FATBINS` with one
/// `(module name, include_bytes!(fat binary))` per compiled file (none without the `cuda`
/// feature).
fn write_table(targets: &str, fatbins: &[(String, PathBuf)]) -> Result<(), String> {
    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| format!("OUT_DIR: {e}"))?);
    let mut table = String::from(
        "// Generated by build.rs: one fat binary per kernels/*.cu file.\n\
         /// Target architectures of every embedded fat binary (cubins, then PTX).\n",
    );
    table.push_str(&format!("pub const TARGETS: &str = {targets:?};\n"));
    table.push_str(
        "/// (module name, fat binary image) per kernels/*.cu file, sorted by name.\n\
         pub const FATBINS: &[(&str, &[u8])] = &[\n",
    );
    for (stem, path) in fatbins {
        table.push_str(&format!(
            "    ({stem:?}, include_bytes!({:?})),\n",
            path.display().to_string()
        ));
    }
    table.push_str("];\n");
    fs::write(out_dir.join("kernels_fatbin.rs"), table)
        .map_err(|e| format!("error: writing kernels_fatbin.rs: {e}"))
}

/// `-gencode` flags: a cubin per cap, PTX for the lowest.
fn gencode_args(caps: &[u32]) -> Vec<String> {
    let mut args: Vec<String> = caps
        .iter()
        .map(|c| format!("-gencode=arch=compute_{c},code=sm_{c}"))
        .collect();
    let lo = caps.iter().min().copied().unwrap_or(80);
    args.push(format!("-gencode=arch=compute_{lo},code=compute_{lo}"));
    args
}

fn targets_string(caps: &[u32]) -> String {
    let mut parts: Vec<String> = caps.iter().map(|c| format!("sm_{c}")).collect();
    parts.push(format!(
        "compute_{}",
        caps.iter().min().copied().unwrap_or(80)
    ));
    parts.join(",")
}

fn compile_one(
    nvcc: &Path,
    kernels_dir: &Path,
    src: &Path,
    caps: &[u32],
    out_dir: &Path,
) -> Result<(String, PathBuf), String> {
    let stem = src
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| format!("error: kernel file name {} is not UTF-8", src.display()))?
        .to_string();
    let out = out_dir.join(format!("{stem}.fatbin"));
    let mut cmd = Command::new(nvcc);
    cmd.arg("--fatbin")
        .args(gencode_args(caps))
        // --fmad=false: no contraction of a*b+c into one FMA, so elementwise kernels round
        // exactly as the CPU reference loops do (Rust never contracts) and the tests can
        // demand bitwise equality; the GEMMs, where FMA matters, are cuBLAS's.
        .args(["-O3", "-std=c++17", "--fmad=false"])
        .arg("-I")
        .arg(kernels_dir)
        .arg("-o")
        .arg(&out)
        .arg(src);
    let shown = format!("{cmd:?}");
    match cmd.output() {
        Ok(o) if o.status.success() => Ok((stem, out)),
        Ok(o) => Err(format!(
            "error: nvcc failed on {} ({})\ncommand: {shown}\n--- nvcc stdout ---\n{}\n--- nvcc stderr ---\n{}",
            src.display(),
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Err(format!("error: could not run nvcc\ncommand: {shown}\n{e}")),
    }
}

/// `CUDA_COMPUTE_CAP` as a list of integers (`90`, `80,90`, `8.0`), default sm_80 + sm_90.
fn compute_caps() -> Result<Vec<u32>, String> {
    let Ok(v) = env::var("CUDA_COMPUTE_CAP") else {
        return Ok(DEFAULT_CAPS.to_vec());
    };
    let mut caps = Vec::new();
    for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let digits: String = part.chars().filter(|c| c.is_ascii_digit()).collect();
        match digits.parse::<u32>() {
            Ok(c) if c >= 50 => caps.push(c),
            _ => {
                return Err(format!(
                "error: CUDA_COMPUTE_CAP={v:?}: expected compute capabilities like `90` or `80,90`"
            ))
            }
        }
    }
    if caps.is_empty() {
        return Err(format!(
            "error: CUDA_COMPUTE_CAP={v:?} names no architecture"
        ));
    }
    caps.sort_unstable();
    caps.dedup();
    Ok(caps)
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env::var_os(var) {
            let p = PathBuf::from(home).join("bin").join("nvcc");
            if p.exists() {
                return Some(p);
            }
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let local = workspace_root().join(".cuda/nvidia/cu13/bin/nvcc");
    local.exists().then_some(local)
}

/// The workspace root (`crates/fsdp-core/../..`), which holds `kernels/` and `.cuda/`.
fn workspace_root() -> PathBuf {
    PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_default()).join("../..")
}
