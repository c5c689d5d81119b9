#!/usr/bin/env bash
# A fresh crate that depends on the fsdp library, as a Rust user's would
# (`fsdp = { path = ..., default-features = false }`), builds only rlibs: no C library
# (libfsdp*.so, libfsdp*.a: those are crates/fsdp-capi's) and no CLI crate (clap,
# indicatif, mimalloc: crates/fsdp-cli's). Builds the throwaway crate under
# target/downstream-check/ with `cargo build` (dev profile, cargo's defaults: the crate's
# own manifest sets no profile) into its own target folder, reads cargo's JSON messages and
# the folder, and fails naming what it found.
#   usage: scripts/downstream_check.sh [--measure] [FSDP_DIR]
#     FSDP_DIR: the checkout whose library to depend on (default: this one);
#     --measure: time the build (/usr/bin/time -v: wall, user+sys CPU, peak memory) and
#       print the target folder's size (du -sh) before the check.
# The target folder is deleted at the end (KEEP=1 keeps it).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
measure=0
if [ "${1:-}" = --measure ]; then measure=1; shift; fi
fsdp_dir="$(cd "${1:-$root}" && pwd)"
work="$root/target/downstream-check"
crate="$work/crate"
tgt="$work/target"
rm -rf "$work"
mkdir -p "$crate/src"
cat >"$crate/Cargo.toml" <<TOML
[package]
name = "fsdp-downstream-check"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
fsdp = { path = "$fsdp_dir", default-features = false }

# Not a member of the fsdp workspace.
[workspace]
TOML
cat >"$crate/src/lib.rs" <<'RS'
//! Uses the library so it is really linked in.
pub fn strategy() -> fsdp::fsdp::ShardingStrategy {
    fsdp::fsdp::ShardingStrategy::default()
}
RS
# The lock file of that checkout: the same dependency versions, nothing to resolve or fetch.
cp "$fsdp_dir/Cargo.lock" "$crate/Cargo.lock"

build=(cargo build --manifest-path "$crate/Cargo.toml" --message-format=json-render-diagnostics)
if [ "$measure" = 1 ]; then
  /usr/bin/time -v -o "$work/time.txt" env CARGO_TARGET_DIR="$tgt" "${build[@]}" \
    >"$work/messages.json"
  grep -E "Elapsed \(wall|User time|System time|Maximum resident" "$work/time.txt"
  echo "target folder: $(du -sh "$tgt" | cut -f1)"
else
  CARGO_TARGET_DIR="$tgt" "${build[@]}" >"$work/messages.json"
fi

fail=0
# What cargo built for the fsdp package: its crate types and files.
python3 - "$work/messages.json" <<'PY' || fail=1
import json, sys
bad, fsdp_seen = [], False
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact":
        continue
    name = m["target"]["name"]
    if name in ("clap", "indicatif", "mimalloc", "fsdp_capi", "fsdp-capi", "fsdp-cli"):
        bad.append(f"built {name}, a crate the library must not pull in")
    # The library is three crates: fsdp over fsdp_core and fsdp_distributed.
    if name in ("fsdp", "fsdp_core", "fsdp_distributed") and "bin" not in m["target"]["kind"]:
        fsdp_seen = fsdp_seen or name == "fsdp"
        kinds = m["target"]["crate_types"]
        if kinds not in (["lib"], ["rlib"]):
            bad.append(f"the {name} library has crate types {kinds}, want only the rlib")
        for f in m["filenames"]:
            if not f.endswith((".rlib", ".rmeta")):
                bad.append(f"the {name} library produced {f}")
if not fsdp_seen:
    bad.append("cargo reported no fsdp library artifact")
for b in bad:
    print("error: " + b, file=sys.stderr)
sys.exit(1 if bad else 0)
PY
# And nothing anywhere in the target folder is a C library of fsdp.
clibs="$(find "$tgt" -name 'libfsdp*.so' -o -name 'libfsdp*.a' | sed "s|^$tgt/||")"
if [ -n "$clibs" ]; then
  echo "error: the downstream target folder holds C libraries:" >&2
  echo "$clibs" >&2
  fail=1
fi
[ "${KEEP:-0}" = 1 ] || rm -rf "$work"
if [ "$fail" = 1 ]; then
  echo "FAIL: a crate depending on fsdp builds more than the library's rlib" >&2
  exit 1
fi
echo "PASS: a crate depending on fsdp (default-features = false) builds only rlibs"
