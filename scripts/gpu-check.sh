#!/usr/bin/env bash
# One command for a lent GPU: the CUDA tests, the kernel benchmarks and a short
# `fsdp train --device cuda`, with a summary under $OUT when set. Well inside 8 minutes.
#
#   scripts/gpu-check.sh prepare   # here (no GPU needed): build everything with
#                                  # --features cuda (release) into .gpu-bin/ (ignored),
#                                  # for a GPU machine without cargo; carry .gpu-bin there
#   scripts/gpu-check.sh           # on the GPU machine: build with cargo when it has one,
#                                  # else run .gpu-bin/; exit 1 when a check failed
#
# Each step has its own timeout; a step that fails is reported and the rest still run.
# What the CUDA path does not have yet (issue 5) is listed under MISSING in the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
bin="$root/.gpu-bin"

if [ "${1:-}" = "prepare" ]; then
  set -e
  nvcc="$(scripts/install_nvcc.sh | tail -n 1)"
  export NVCC="$nvcc"
  rm -rf "$bin" && mkdir -p "$bin"
  for t in kernels kernels_nn; do
    exe="$(cargo test --release --features cuda --test "$t" --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]: print(m["executable"])' | tail -n 1)"
    cp "$exe" "$bin/test-$t"
  done
  exe="$(cargo bench --features cuda --bench kernels --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["bench"]: print(m["executable"])' | tail -n 1)"
  cp "$exe" "$bin/bench-kernels"
  cargo build --release --features cuda --bin fsdp
  cp target/release/fsdp "$bin/fsdp"
  strip "$bin"/* || true
  du -sh "$bin"
  echo "prepared $bin: carry it (run's carry: [\".gpu-bin\"]) and run scripts/gpu-check.sh there"
  exit 0
fi

out="${OUT:-$root/target/gpu-check}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
fail=0
say() { echo "$*" | tee -a "$summary"; }
step() { # step NAME TIMEOUT_S 'SHELL COMMAND': runs, logs to $out/NAME.log, records PASS/FAIL
  local name="$1" t="$2" cmd="$3"
  local start=$SECONDS
  timeout "$t" bash -c "$cmd" >"$out/$name.log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then say "PASS $name ($((SECONDS - start)) s)"; else
    say "FAIL $name (exit $rc after $((SECONDS - start)) s; last lines:)"
    tail -n 15 "$out/$name.log" | sed 's/^/    /' | tee -a "$summary"
    fail=1
  fi
  return $rc
}

say "== gpu-check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$summary"

# cuBLAS from CUDA's pip wheels (the image's PyTorch ships them) when not on the path.
if ! ldconfig -p 2>/dev/null | grep -q libcublas.so; then
  libdir="$(python3 - <<'PY' 2>/dev/null
import glob, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for f in glob.glob(d + "/nvidia/**/libcublas.so*", recursive=True):
        print(f.rsplit("/", 1)[0]); sys.exit()
PY
)"
  [ -n "$libdir" ] && export LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}" && say "cublas: $libdir"
fi

if command -v cargo >/dev/null 2>&1; then
  say "build: cargo (--features cuda, release)"
  step build 300 'NVCC="$(scripts/install_nvcc.sh | tail -n 1)" && export NVCC &&
    cargo test --release --features cuda --test kernels --test kernels_nn --no-run &&
    cargo build --release --features cuda --bin fsdp && cargo bench --features cuda --bench kernels --no-run'
  test_cmd="cargo test --release --features cuda --test %s -- --nocapture --test-threads 1 _cuda"
  bench_cmd="cargo bench --features cuda --bench kernels"
  fsdp_bin="$root/target/release/fsdp"
elif [ -x "$bin/fsdp" ]; then
  say "build: prebuilt $bin (scripts/gpu-check.sh prepare)"
  test_cmd="$bin/test-%s --nocapture --test-threads 1 _cuda"
  bench_cmd="$bin/bench-kernels --bench"
  fsdp_bin="$bin/fsdp"
else
  say "FAIL build: no cargo here and no $bin (run 'scripts/gpu-check.sh prepare' where cargo is, carry .gpu-bin)"
  exit 1
fi

for t in kernels kernels_nn; do
  # shellcheck disable=SC2059
  step "test-$t" 180 "$(printf "$test_cmd" "$t")"
  if grep -q "skipping" "$out/test-$t.log"; then
    say "FAIL test-$t: CUDA tests skipped on a GPU machine:"; grep -m3 skipping "$out/test-$t.log" | tee -a "$summary"; fail=1
  fi
  grep -E "^test .*_cuda \.\.\. (ok|FAILED)" "$out/test-$t.log" | sed 's/^/    /' >>"$summary"
done
step bench-kernels 240 "$bench_cmd"
grep -E "^BW " "$out/bench-kernels.log" | tee -a "$summary"

# fsdp train --device cuda: the FSDP runtime on CUDA tensors is not built yet; today the
# command must find the GPU and say so in one line (exit 1) rather than train.
mkdir -p "$root/data"
[ -f "$root/data/tinyshakespeare.txt" ] || python3 -c "print('the king and queen of rome shall speak\n' * 3000)" >"$root/data/gpu-check.txt"
data="$root/data/tinyshakespeare.txt"; [ -f "$data" ] || data="$root/data/gpu-check.txt"
timeout 60 "$fsdp_bin" train --device cuda --world-size 1 --steps 20 --data "$data" >"$out/train-cuda.log" 2>&1
rc=$?
if grep -q "training on CUDA tensors" "$out/train-cuda.log"; then
  say "MISSING train-cuda: $(head -c 300 "$out/train-cuda.log")"
elif [ $rc -eq 0 ]; then
  say "PASS train-cuda"; tail -n 5 "$out/train-cuda.log" | tee -a "$summary"
else
  say "FAIL train-cuda (exit $rc):"; tail -n 5 "$out/train-cuda.log" | tee -a "$summary"; fail=1
fi

say "MISSING (issue 5): FSDP runtime on CUDA tensors (fsdp train --device cuda), threads process group on device buffers, NCCL backend, gpt2-124m preset, GPU-vs-CPU loss-curve and world-size-4 parity runs, tokens/s and MFU"
say "== $( [ $fail -eq 0 ] && echo 'gpu-check passed' || echo 'gpu-check FAILED' ) (logs in $out)"
exit $fail
