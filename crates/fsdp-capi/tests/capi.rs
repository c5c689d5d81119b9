//! The C ABI (this crate, `include/fsdp.h`) from foreign hosts: a C program that
//! computes an MLP and trains it through the ABI on its own threads (`c_host`), a Python
//! program with ctypes and numpy under `fsdp launch` (`python_host`), bad input from C
//! (`bad_input`), the contract that refuses what would train wrong (`contract`), and the
//! header against the Rust declarations (`header`).

#[path = "../../../tests/common/mod.rs"]
mod common;

#[path = "capi/bad_input.rs"]
mod bad_input;
#[path = "capi/c_host.rs"]
mod c_host;
#[path = "capi/contract.rs"]
mod contract;
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

/// Checks the report of a C check program (`tests/capi/abi_checks.c`,
/// `tests/capi/contract.c`): one `CASE <name> <status> <message>` line per expected
/// failure, whose status must be `cases`' and whose message must contain its text, and
/// one `CHECK <name> ok|FAIL <detail>` line per checked value, each in `checks` and `ok`;
/// nothing else, nothing missing. Returns the messages by case.
pub fn assert_report(
    out: &str,
    cases: &[(&str, &str, &str)],
    checks: &[&str],
) -> std::collections::BTreeMap<String, String> {
    println!("{out}");
    let mut got = std::collections::BTreeMap::new();
    let mut checked = std::collections::BTreeMap::new();
    for line in out.lines() {
        let mut f = line.splitn(4, ' ');
        match (f.next(), f.next(), f.next()) {
            (Some("CASE"), Some(name), Some(status)) => {
                got.insert(
                    name.to_string(),
                    (status.to_string(), f.next().unwrap_or("").to_string()),
                );
            }
            (Some("CHECK"), Some(name), Some(ok)) => {
                let detail = f.next().unwrap_or("").to_string();
                checked.insert(name.to_string(), (ok == "ok", detail));
            }
            _ => panic!("unexpected line: {line}"),
        }
    }
    for (name, status, msg) in cases {
        let (s, text) = got
            .get(*name)
            .unwrap_or_else(|| panic!("case {name} missing"));
        assert_eq!(s, status, "{name}: {text}");
        assert!(
            text.contains(msg),
            "{name}: {text:?} does not contain {msg:?}"
        );
    }
    assert_eq!(got.len(), cases.len(), "cases: {:?}", got.keys());
    for name in checks {
        let (ok, detail) = checked
            .get(*name)
            .unwrap_or_else(|| panic!("check {name} missing"));
        assert!(ok, "check {name}: {detail}");
    }
    assert_eq!(checked.len(), checks.len(), "checks: {:?}", checked.keys());
    got.into_iter().map(|(k, (_, m))| (k, m)).collect()
}
