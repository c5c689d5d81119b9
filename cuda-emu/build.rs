//! Compiles `../kernels/*.cu` as host C++ against the stand-in headers of `cpp/` and lists
//! every `extern "C"` kernel in a table the emulated driver looks names up in.
//!
//! For each `kernels/<stem>.cu`: the preprocessed source (`c++ -E`) gives the kernel names
//! (the sources stamp kernels out with macros); a generated `emu_<stem>.cpp` includes the
//! `.cu` and defines `emu_table_<stem>`; `emu_index.cpp` defines `emu_find_kernel`.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;
use std::process::Command;

/// The end (exclusive) of the bracketed group opening at `open` (`(`/`{`), or None.
fn matching(text: &str, open: usize, l: u8, r: u8) -> Option<usize> {
    let mut depth = 0usize;
    for (k, &c) in text.as_bytes()[open..].iter().enumerate() {
        if c == l {
            depth += 1;
        } else if c == r {
            depth -= 1;
            if depth == 0 {
                return Some(open + k + 1);
            }
        }
    }
    None
}

/// What, in a kernel body, makes threads of a block wait for each other (cuda_emu.h).
/// `_synced`: the kernels/*.cu convention for a templated body that reaches a barrier,
/// called from an `extern "C"` wrapper whose own body holds only that call.
const BARRIERS: [&str; 8] = [
    "__syncthreads",
    "__shfl",
    "block_sum",
    "block_max",
    "warp_sum",
    "warp_max",
    "column_sums",
    "_synced",
];

/// The `extern "C"` kernels of a preprocessed `.cu`: name, and whether the body reaches a
/// barrier (those run as fibers; the others as plain calls, one per thread).
fn kernels_of(preprocessed: &str) -> Vec<(String, bool)> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(k) = preprocessed[at..].find("extern \"C\"") {
        at += k + "extern \"C\"".len();
        let t = preprocessed[at..].trim_start();
        let Some(t) = t.strip_prefix("void") else {
            continue;
        };
        if !t.starts_with(char::is_whitespace) {
            continue;
        }
        let t = t.trim_start();
        let name: String = t
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // emu_* are the runtime's own C functions (cuda_emu.h), not kernels.
        if name.is_empty()
            || name.starts_with("emu_")
            || !t[name.len()..].trim_start().starts_with('(')
        {
            continue;
        }
        let start = preprocessed.len() - t.len() + name.len();
        let open = start + preprocessed[start..].find('(').expect("checked above");
        let body = matching(preprocessed, open, b'(', b')')
            .and_then(|end| Some(end + preprocessed[end..].find('{')?))
            .and_then(|b| Some(&preprocessed[b..matching(preprocessed, b, b'{', b'}')?]))
            .unwrap_or_else(|| panic!("kernel {name}: no body found"));
        found.push((name, BARRIERS.iter().any(|m| body.contains(m))));
    }
    found
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let kernels = manifest
        .join("../kernels")
        .canonicalize()
        .expect("kernels/ beside cuda-emu/");
    let cpp = manifest.join("cpp");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", cpp.display());

    let mut sources: Vec<PathBuf> = fs::read_dir(&kernels)
        .expect("reading kernels/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    for p in fs::read_dir(&kernels).expect("reading kernels/").flatten() {
        println!("cargo:rerun-if-changed={}", p.path().display());
    }

    let base = || {
        let mut b = cc::Build::new();
        b.cpp(true)
            .std("c++17")
            .include(&cpp)
            .include(&kernels)
            .flag("-ffp-contract=off")
            .flag("-fno-fast-math")
            // TLS descriptors: fast thread-local reads in a dlopen'ed library (cuda_emu.h)
            .flag("-mtls-dialect=gnu2")
            .flag_if_supported("-Wno-unused-parameter")
            .opt_level(2);
        b
    };
    let compiler = base().get_compiler();

    let mut build = base();
    build.file(cpp.join("runtime.cpp"));
    let mut index = String::from("#include <cstring>\n#include \"registry.h\"\n");
    let mut stems = Vec::new();
    for src in &sources {
        let stem = src
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("UTF-8 kernel file name");
        let pre = Command::new(compiler.path())
            .args(["-E", "-x", "c++", "-std=c++17"])
            .arg("-I")
            .arg(&cpp)
            .arg("-I")
            .arg(&kernels)
            .arg(src)
            .output()
            .unwrap_or_else(|e| panic!("running {:?} -E: {e}", compiler.path()));
        if !pre.status.success() {
            panic!(
                "preprocessing {} failed:\n{}",
                src.display(),
                String::from_utf8_lossy(&pre.stderr)
            );
        }
        let names = kernels_of(&String::from_utf8_lossy(&pre.stdout));
        let mut w = format!("#include \"{}\"\n#include \"registry.h\"\n", src.display());
        writeln!(w, "extern \"C\" const EmuKernel emu_table_{stem}[] = {{").unwrap();
        for (n, barriers) in &names {
            writeln!(w, "  EMU_KERNEL({n}, {}),", *barriers as u8).unwrap();
        }
        w.push_str("  EmuKernel{nullptr, nullptr, nullptr, 0, nullptr, 0},\n};\n");
        let file = out.join(format!("emu_{stem}.cpp"));
        fs::write(&file, w).expect("writing a kernel table");
        build.file(&file);
        writeln!(index, "extern \"C\" const EmuKernel emu_table_{stem}[];").unwrap();
        stems.push(stem.to_string());
    }
    index.push_str(
        "// The kernel called `name`, or null.\nextern \"C\" const EmuKernel* emu_find_kernel(const char* name) {\n  const EmuKernel* tables[] = {",
    );
    for s in &stems {
        write!(index, "emu_table_{s}, ").unwrap();
    }
    index.push_str(
        "};\n  for (const EmuKernel* t : tables)\n    for (; t->name != nullptr; ++t)\n      if (std::strcmp(t->name, name) == 0) return t;\n  return nullptr;\n}\n",
    );
    let file = out.join("emu_index.cpp");
    fs::write(&file, index).expect("writing the kernel index");
    build.file(&file);
    build.compile("cuda_emu_kernels");
}
