//! The layer table of `src/lib.rs`, enforced inside each of the library's crates: no file
//! of a top-level module refers to a module of a higher layer (`crate::x`, `$crate::x`,
//! `use crate::{x, ..}`, a `super::` chain that climbs to the crate root, or
//! `fsdp_core::x`). Modules of one row may refer to each other. Across crates the compiler
//! enforces the table: `fsdp-core` (the first rows) depends on nothing of the library,
//! `fsdp-distributed` on `fsdp-core` only, and each crate imports the lower crates' modules
//! at its root, so `crate::tensor` names the same module in all three.
//!
//! The table is read from the crate docs themselves (the rows after the `| layer | crate |
//! modules | owns |` header, bottom layer first; every backticked name in the modules column
//! is a top-level module of that row, declared by the row's crate), so the docs a reader
//! trusts are the rule CI checks, and a module missing from the table, or declared by
//! another crate than its row names, is an error too. Comments, doc comments and string
//! literals are skipped: a doc link up the table is not an import. The C ABI
//! (`crates/fsdp-capi/`) and the command line (`crates/fsdp-cli/`) are crates of their own
//! above every layer, which reach the library through its public API only.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Layers bottom first: `layers[h]` are the top-level modules at height `h`, in the crate
/// `crates[h]` (`"fsdp"` when the table has no crate column).
#[derive(Debug)]
struct Table {
    layers: Vec<Vec<String>>,
    crates: Vec<String>,
    /// Items `lib.rs` re-exports at the root (`pub use error::{Error, Result}`): `crate::Error`
    /// is a reference to `error`.
    root_items: BTreeMap<String, String>,
}

impl Table {
    fn height(&self, name: &str) -> Option<usize> {
        let module = self.root_items.get(name).map_or(name, String::as_str);
        self.layers
            .iter()
            .position(|row| row.iter().any(|m| m == module))
    }
}

/// `name -> module` for every `pub use module::name` / `pub use module::{a, b}` of `lib.rs`.
fn root_items(lib_rs: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in strip(lib_rs).split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let rest: String = rest.chars().filter(|c| !c.is_whitespace()).collect();
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        if module.starts_with("fsdp_") {
            continue; // a lower crate's modules, re-exported under their own names
        }
        let names = names.trim_start_matches('{').trim_end_matches('}');
        for n in names.split(',').filter(|n| !n.is_empty()) {
            let n = n.rsplit(" as ").next().unwrap_or(n);
            let n = n.rsplit("::").next().unwrap_or(n);
            out.insert(n.to_string(), module.to_string());
        }
    }
    out
}

/// Reads the layer table from the crate docs (`//! | layer | crate | modules | owns |`
/// rows; the crate column is optional).
fn parse_table(lib_rs: &str) -> Table {
    let mut layers = Vec::new();
    let mut crates = Vec::new();
    let mut in_table = false;
    let (mut crate_col, mut modules_col) = (None, 1);
    for line in lib_rs.lines() {
        let Some(row) = line.trim().strip_prefix("//!") else {
            if in_table {
                break;
            }
            continue;
        };
        let row = row.trim();
        if !row.starts_with('|') {
            if in_table {
                break;
            }
            continue;
        }
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        if cells.first() == Some(&"layer") && cells.contains(&"modules") {
            in_table = true;
            crate_col = cells.iter().position(|c| *c == "crate");
            modules_col = cells.iter().position(|c| *c == "modules").unwrap();
            continue;
        }
        if !in_table || cells[0].starts_with("---") {
            continue;
        }
        let modules: Vec<String> = cells[modules_col]
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|s| s.to_string())
            .collect();
        layers.push(modules);
        crates.push(
            crate_col
                .map_or("fsdp", |c| cells[c].trim_matches('`'))
                .to_string(),
        );
    }
    Table {
        layers,
        crates,
        root_items: root_items(lib_rs),
    }
}

/// The `mod NAME;` declarations of `lib.rs`.
fn declared_modules(lib_rs: &str) -> Vec<String> {
    let code = strip(lib_rs);
    let mut out = Vec::new();
    for line in code.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some(i) = words.iter().position(|w| *w == "mod") {
            if let Some(name) = words.get(i + 1) {
                if let Some(name) = name.strip_suffix(';') {
                    out.push(name.to_string());
                }
            }
        }
    }
    out
}

/// `src` with comments and the contents of string and char literals blanked (newlines
/// kept, so line numbers stay).
fn strip(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && (i == 0 || !is_ident(b[i - 1]))
        {
            // Raw string r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            out.push_str(&" ".repeat(j + 1 - i));
            i = j + 1;
            while i < b.len() {
                if b[i] == '"' && (1..=hashes).all(|k| b.get(i + k) == Some(&'#')) {
                    out.push_str(&" ".repeat(1 + hashes));
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(b[i]));
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A char literal ('a', '\n', '\u{..}') or a lifetime ('a).
            if next == Some('\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != '\'' {
                    j += 1;
                }
                out.push_str(&" ".repeat(j + 1 - i));
                i = j + 1;
            } else if b.get(i + 2) == Some(&'\'') {
                out.push_str("   ");
                i += 3;
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// One reference from a file to a top-level module: (line, module).
type Ref = (usize, String);

/// The top-level modules that `code` (already [`strip`]ped) refers to, for a file whose
/// module path is `module_path` (`["tensor", "storage"]` for `crates/fsdp-core/src/tensor/storage.rs`).
fn references(code: &str, module_path: &[String]) -> Vec<Ref> {
    let b: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let line_of = |pos: usize| b[..pos].iter().filter(|&&c| c == '\n').count() + 1;
    // Inline `mod name { .. }` blocks open so far, by the brace depth inside them: each
    // adds one `super` to the climb to the root.
    let mut depth = 0usize;
    let mut inline_mods: Vec<usize> = Vec::new();
    let mut pending_mod = false;
    while i < b.len() {
        match b[i] {
            '{' => {
                depth += 1;
                if pending_mod {
                    inline_mods.push(depth);
                    pending_mod = false;
                }
            }
            '}' => {
                if inline_mods.last() == Some(&depth) {
                    inline_mods.pop();
                }
                depth = depth.saturating_sub(1);
            }
            ';' => pending_mod = false,
            _ => {}
        }
        if !is_ident(b[i]) || (i > 0 && is_ident(b[i - 1])) {
            i += 1;
            continue;
        }
        let word_end = (i..b.len()).find(|&j| !is_ident(b[j])).unwrap_or(b.len());
        let word: String = b[i..word_end].iter().collect();
        if word == "mod" {
            pending_mod = true;
        }
        let levels = module_path.len() + inline_mods.len();
        let at_root = match word.as_str() {
            // A lower crate's root holds its modules under their own names (fsdp-distributed's
            // only module is `distributed`, `fsdp_distributed::distributed`).
            "crate" | "fsdp_core" | "fsdp_distributed" => Some(word_end),
            "super" => {
                // A chain super::super::...: it reaches the root after len(module_path).
                let mut n = 1;
                let mut j = word_end;
                loop {
                    let k = skip_ws(&b, j);
                    if b.get(k) == Some(&':') && b.get(k + 1) == Some(&':') {
                        let k2 = skip_ws(&b, k + 2);
                        let e = (k2..b.len()).find(|&e| !is_ident(b[e])).unwrap_or(b.len());
                        if b[k2..e].iter().collect::<String>() == "super" {
                            n += 1;
                            j = e;
                            continue;
                        }
                    }
                    break;
                }
                if n >= levels && levels > 0 {
                    Some(j)
                } else {
                    i = j;
                    None
                }
            }
            _ => None,
        };
        let Some(mut j) = at_root else {
            i = word_end.max(i + 1);
            continue;
        };
        j = skip_ws(&b, j);
        if !(b.get(j) == Some(&':') && b.get(j + 1) == Some(&':')) {
            i = j.max(i + 1);
            continue;
        }
        j = skip_ws(&b, j + 2);
        let line = line_of(i);
        if b.get(j) == Some(&'{') {
            // use crate::{a::x, b, c::{..}}: the first name of each top-level item.
            let mut depth = 0;
            let mut expect_name = true;
            let mut k = j;
            while k < b.len() {
                match b[k] {
                    '{' => {
                        depth += 1;
                        if depth == 1 {
                            expect_name = true;
                        }
                    }
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => expect_name = true,
                    c if depth == 1 && expect_name && is_ident(c) => {
                        let e = (k..b.len()).find(|&e| !is_ident(b[e])).unwrap_or(b.len());
                        let name: String = b[k..e].iter().collect();
                        if name != "self" {
                            out.push((line_of(k), name));
                        }
                        expect_name = false;
                        k = e;
                        continue;
                    }
                    _ => {}
                }
                k += 1;
            }
            i = k + 1;
        } else {
            let e = (j..b.len()).find(|&e| !is_ident(b[e])).unwrap_or(b.len());
            if e > j {
                out.push((line, b[j..e].iter().collect()));
            }
            i = e.max(i + 1);
        }
    }
    out
}

fn skip_ws(b: &[char], mut j: usize) -> usize {
    while j < b.len() && b[j].is_whitespace() {
        j += 1;
    }
    j
}

/// Every violation of `table` by the file at `module_path` with source `src`, as
/// `"LINE: FROM (layer H) refers to TO (layer H')"`.
fn violations(table: &Table, module_path: &[String], src: &str) -> Vec<String> {
    let Some(top) = module_path.first() else {
        return Vec::new(); // lib.rs: the root declares and re-exports every layer
    };
    let mut out = Vec::new();
    let Some(h) = table.height(top) else {
        return vec![format!(
            "module `{top}` is not in the layer table of src/lib.rs"
        )];
    };
    for (line, to) in references(&strip(src), module_path) {
        match table.height(&to) {
            Some(h2) if h2 > h => out.push(format!(
                "{line}: `{top}` (layer {h}) refers to `{to}` (layer {h2}), a layer above it"
            )),
            Some(_) => {}
            None => out.push(format!(
                "{line}: `{top}` refers to `crate::{to}`, which is not in the layer table"
            )),
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `["tensor", "storage"]` for `tensor/storage.rs`, `["tensor"]` for `tensor/mod.rs`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// The library's crates, by the names of the table's crate column: (name, folder of its
/// `src/`, relative to the workspace root).
const CRATES: &[(&str, &str)] = &[
    ("fsdp-core", "crates/fsdp-core/src"),
    ("fsdp-distributed", "crates/fsdp-distributed/src"),
    ("fsdp", "src"),
];

#[test]
fn no_module_refers_to_a_layer_above_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib_rs = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let mut table = parse_table(&lib_rs);
    assert!(
        table.layers.len() >= 5,
        "src/lib.rs has no layer table (| layer | crate | modules | owns |): {table:?}"
    );
    let mut problems = Vec::new();
    for c in &table.crates {
        if !CRATES.iter().any(|(name, _)| name == c) {
            problems.push(format!(
                "src/lib.rs: the layer table names crate `{c}`, which is not one of {CRATES:?}"
            ));
        }
    }
    // Each crate's `pub use error::{Error, ..}` items count as their modules everywhere.
    for (_, dir) in CRATES {
        let lib = std::fs::read_to_string(root.join(dir).join("lib.rs")).unwrap();
        table.root_items.extend(root_items(&lib));
    }
    let mut checked = BTreeMap::new();
    for (name, dir) in CRATES {
        let src = root.join(dir);
        let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
        let declared = declared_modules(&lib);
        for m in &declared {
            match table.height(m) {
                None => problems.push(format!(
                    "{dir}/lib.rs: module `{m}` is not in the layer table"
                )),
                Some(h) if table.crates[h] != *name => problems.push(format!(
                    "{dir}/lib.rs: module `{m}` is in crate `{name}`, the layer table says `{}`",
                    table.crates[h]
                )),
                Some(_) => {}
            }
        }
        for (row, c) in table.layers.iter().zip(&table.crates) {
            for m in row.iter().filter(|_| c == name) {
                if !declared.contains(m) {
                    problems.push(format!(
                        "{dir}/lib.rs: the layer table names `{m}` in `{name}`, which its lib.rs does not declare"
                    ));
                }
            }
        }
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        files.sort();
        for f in files {
            let rel = f.strip_prefix(&src).unwrap();
            let path = module_path(rel);
            let text = std::fs::read_to_string(&f).unwrap();
            for v in violations(&table, &path, &text) {
                problems.push(format!("{dir}/{}:{v}", rel.display()));
            }
            *checked
                .entry(path.first().cloned().unwrap_or_default())
                .or_insert(0) += 1;
        }
    }
    assert!(
        problems.is_empty(),
        "{} upward reference(s) against the layer table of src/lib.rs \
         (bottom first: {:?}):\n{}",
        problems.len(),
        table.layers,
        problems.join("\n")
    );
    assert!(checked.len() >= 10, "too few modules scanned: {checked:?}");
}

// The checker itself, on synthetic input: it must see every form of an upward import and
// nothing in comments or strings.

fn toy_table() -> Table {
    parse_table(
        "//! intro\n//!\n//! | layer | modules | owns |\n//! |---|---|---|\n\
         //! | shared | [`error`], `hash` | leaves |\n//! | tensor | [`tensor`] | tensors |\n\
         //! | nn / optim | [`nn`], [`optim`] | modules |\n//!\n//! more\n\
         pub mod error;\npub use error::{Error, Result};\npub use nn::Linear;\n",
    )
}

fn p(s: &str) -> Vec<String> {
    s.split('/').map(str::to_string).collect()
}

#[test]
fn the_table_is_read_from_the_docs() {
    let t = toy_table();
    assert_eq!(
        t.layers,
        vec![vec!["error", "hash"], vec!["tensor"], vec!["nn", "optim"]]
    );
    assert_eq!(t.root_items["Result"], "error");
    assert_eq!(t.root_items["Linear"], "nn");
    assert_eq!(
        declared_modules("pub mod a;\nmod b;\n#[cfg(x)]\npub(crate) mod c;\n// mod d;\n"),
        vec!["a", "b", "c"]
    );
    // The crate column, and references through a lower crate's name.
    let t = parse_table(
        "//! | layer | crate | modules | owns |\n//! |---|---|---|---|\n\
         //! | shared | `fsdp-core` | [`error`] | leaves |\n\
         //! | distributed | `fsdp-distributed` | [`distributed`] | groups |\n\
         //! | nn | `fsdp` | [`nn`] | modules |\n\
         pub use fsdp_core::{error, tensor};\npub use fsdp_distributed::distributed;\n",
    );
    assert_eq!(
        t.layers,
        vec![vec!["error"], vec!["distributed"], vec!["nn"]]
    );
    assert_eq!(t.crates, vec!["fsdp-core", "fsdp-distributed", "fsdp"]);
    assert!(t.root_items.is_empty(), "{:?}", t.root_items);
    let v = violations(
        &t,
        &p("error"),
        "fn f() { fsdp_distributed::distributed::x(); }",
    );
    assert_eq!(v.len(), 1, "{v:?}");
    let v = violations(
        &t,
        &p("distributed/a"),
        "use fsdp_core::{error::Result, nn};",
    );
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(violations(&t, &p("nn"), "use fsdp_core::error::Error;").is_empty());
}

#[test]
fn an_upward_import_fails() {
    let t = toy_table();
    let bad = [
        ("tensor/storage", "use crate::nn::ParamInit;\n"),
        ("tensor", "fn f() { let _ = crate :: nn::gelu(1.0); }"),
        ("tensor/mod", "use crate::{error::Result, optim::Sgd};"),
        (
            "tensor/a",
            "use crate::{\n    error::{Error, Result},\n    nn,\n};",
        ),
        ("tensor/a", "use super::super::nn::Linear;"),
        ("tensor", "use super::nn;"),
        ("tensor/a", "use super::super::{error, optim};"),
        (
            "error",
            "macro_rules! m { () => { $crate::tensor::Tensor::scalar(1.0) } }",
        ),
        ("hash", "pub fn f(t: &crate::tensor::Tensor) {}"),
        ("tensor", "fn f() -> crate::Linear { todo!() }"),
        (
            "tensor/a",
            "mod tests { mod more { use super::super::super::super::nn; } }",
        ),
    ];
    for (file, src) in bad {
        let v = violations(&t, &p(file), src);
        assert_eq!(v.len(), 1, "{file}: {src:?} gave {v:?}");
        assert!(v[0].contains("a layer above it"), "{v:?}");
    }
    // A module missing from the table is named.
    let v = violations(&t, &p("train/job"), "fn f() {}");
    assert!(v[0].contains("`train` is not in the layer table"), "{v:?}");
    let v = violations(&t, &p("tensor"), "use crate::train::Job;");
    assert!(v[0].contains("not in the layer table"), "{v:?}");
}

#[test]
fn downward_same_layer_comments_and_strings_pass() {
    let t = toy_table();
    let good = [
        ("nn/linear", "use crate::tensor::Tensor;\nuse crate::optim::Sgd;\nuse crate::{error::Result, hash};"),
        ("nn/linear", "use super::Module; use super::super::tensor::Tensor;"),
        ("nn/a/b", "use super::super::Module;"),
        ("tensor", "/// See [`crate::nn::Linear`].\n// crate::optim::x\n/* crate::nn /* nested */ crate::nn */ fn f() {}"),
        ("tensor", "const S: &str = \"crate::nn::x\"; const R: &str = r#\"crate::nn \"x\" \"#; const C: char = '\"'; fn g<'a>(x: &'a str) -> &'a str { x }"),
        ("tensor", "pub(crate) fn f() {} pub(in crate::tensor) fn g() {}"),
        ("error", "use crate::{self as root, hash::fnv1a};"),
        ("nn", "fn f() -> crate::Result<()> { Err(crate::Error::X) }"),
        ("tensor/a", "#[cfg(test)]\nmod tests {\n    use super::super::Tensor;\n    use super::super::super::tensor;\n}\nuse super::Tensor;"),
        ("hash", "mod tests { fn t() { super::fnv1a(b\"\"); } }"),
    ];
    for (file, src) in good {
        let v = violations(&t, &p(file), src);
        assert!(v.is_empty(), "{file}: {src:?} gave {v:?}");
    }
}
