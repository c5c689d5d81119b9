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

fn kernel_names(preprocessed: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = preprocessed;
    while let Some(at) = rest.find("extern \"C\"") {
        rest = &rest[at + "extern \"C\"".len()..];
        let t = rest.trim_start();
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
        if !name.is_empty()
            && !name.starts_with("emu_")
            && t[name.len()..].trim_start().starts_with('(')
        {
            names.push(name);
        }
    }
    names
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
        let names = kernel_names(&String::from_utf8_lossy(&pre.stdout));
        let mut w = format!("#include \"{}\"\n#include \"registry.h\"\n", src.display());
        writeln!(w, "extern \"C\" const EmuKernel emu_table_{stem}[] = {{").unwrap();
        for n in &names {
            writeln!(w, "  EMU_KERNEL({n}),").unwrap();
        }
        w.push_str("  EmuKernel{nullptr, nullptr, nullptr, 0, nullptr},\n};\n");
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
