//! The C ABI (this crate, `include/fsdp.h`) from foreign hosts: a C program that
//! computes an MLP and trains it through the ABI on its own threads (`c_host`), a Python
//! program with ctypes and numpy under `fsdp launch` (`python_host`), bad input from C
//! (`bad_input`), and the header against the Rust declarations (`header`).

#[path = "../../../tests/common/mod.rs"]
mod common;

#[path = "capi/bad_input.rs"]
mod bad_input;
#[path = "capi/c_host.rs"]
mod c_host;
#[path = "capi/header.rs"]
mod header;
#[path = "capi/python_host.rs"]
mod python_host;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where cargo put `libfsdp_capi.so` and `libfsdp_capi.a` for this test binary (its own
/// folder).
pub fn lib_dir() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Compiles the C program `src` (relative to the crate root) against `include/fsdp.h`
/// and links `libfsdp_capi.so` with the cc crate's compiler, once per test process (tests run
/// in parallel); returns the executable.
pub fn compile_c(src: &str) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, exe)) = built.iter().find(|(s, _)| s == src) {
        return exe.clone();
    }
    let exe = compile_c_now(src);
    built.push((src.to_string(), exe.clone()));
    exe
}

fn compile_c_now(src: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let name = Path::new(src).file_stem().unwrap().to_str().unwrap();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("capi-{name}"));
    let target = env!("FSDP_TARGET");
    let compiler = cc::Build::new()
        .target(target)
        .host(target)
        .opt_level(2)
        .debug(false)
        .cargo_metadata(false)
        .cargo_warnings(false)
        .get_compiler();
    let lib = lib_dir();
    let mut cmd = compiler.to_command();
    cmd.args([
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-pedantic",
        "-pthread",
    ])
    .arg(format!("-I{}", root.join("include").display()))
    .arg(root.join(src))
    .arg("-o")
    .arg(&out)
    .arg(format!("-L{}", lib.display()))
    .arg("-lfsdp_capi")
    .arg(format!("-Wl,-rpath,{}", lib.display()))
    .arg("-lm");
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "compiling {src} failed: {:?} {:?}\n{}",
        cmd.get_program(),
        cmd.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// Runs `cmd`, asserts it succeeded, returns its stdout.
pub fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}
