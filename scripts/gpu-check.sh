#!/usr/bin/env bash
# One command for a lent GPU: the CUDA tests, the kernel benchmarks, CPU-vs-GPU and
# world-size loss curves, and `fsdp train --device cuda --preset gpt2-124m` throughput,
# with a summary under $OUT when set. Whole run bounded by BUDGET_S (default 450 s, well
# inside 8 minutes): every step gets at most its own timeout and what is left of the
# budget; steps that no longer fit are reported SKIPPED.
#
#   scripts/gpu-check.sh prepare   # here (no GPU needed): build everything with
#                                  # --features cuda (release) into .gpu-bin/ (ignored),
#                                  # for a GPU machine without cargo; carry .gpu-bin there
#   scripts/gpu-check.sh           # on the GPU machine: build with cargo when it has one,
#                                  # else run .gpu-bin/; exit 1 when a check failed
#
# Each step has its own timeout; a step that fails is reported and the rest still run.
# What is not checked on one GPU is listed under NOT CHECKED HERE in the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
bin="$root/.gpu-bin"
# Test binaries with CUDA variants (`*_cuda` tests); missing ones are skipped, so a test
# file another branch adds (the nn layers on device) is picked up once it exists.
CUDA_TESTS="kernels kernels_nn ops_device nn_device fsdp_cuda distributed"

exe_of() { # exe_of KIND: the last executable of that kind in cargo's JSON messages
  python3 -c 'import json,sys
kind=sys.argv[1]
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==[kind]: print(m["executable"])' "$1" | tail -n 1
}

if [ "${1:-}" = "prepare" ]; then
  set -e
  nvcc="$(scripts/install_nvcc.sh | tail -n 1)"
  export NVCC="$nvcc"
  rm -rf "$bin" && mkdir -p "$bin"
  for t in $CUDA_TESTS; do
    if [ ! -f "tests/$t.rs" ]; then echo "prepare: no tests/$t.rs, skipped"; continue; fi
    exe="$(cargo test --release --features cuda --test "$t" --no-run --message-format=json 2>/dev/null | exe_of test)"
    cp "$exe" "$bin/test-$t"
  done
  exe="$(cargo bench --features cuda --bench kernels --no-run --message-format=json 2>/dev/null | exe_of bench)"
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
budget="${BUDGET_S:-450}"
say() { echo "$*" | tee -a "$summary"; }
step() { # step NAME TIMEOUT_S 'SHELL COMMAND': runs, logs to $out/NAME.log, records PASS/FAIL
  local name="$1" t="$2" cmd="$3"
  local left=$((budget - SECONDS))
  if [ "$left" -lt 15 ]; then say "SKIPPED $name (time budget of $budget s spent)"; fail=1; return 1; fi
  [ "$t" -gt "$left" ] && t="$left"
  local start=$SECONDS
  timeout "$t" bash -c "$cmd" >"$out/$name.log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then say "PASS $name ($((SECONDS - start)) s)"; else
    say "FAIL $name (exit $rc after $((SECONDS - start)) s of at most $t; last lines:)"
    tail -n 15 "$out/$name.log" | sed 's/^/    /' | tee -a "$summary"
    fail=1
  fi
  return $rc
}

say "== gpu-check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), budget $budget s"
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

# NCCL from the pip wheel (nvidia-nccl-cu13/cu12 ship libnccl.so.2 only; cudarc opens
# libnccl.so): a folder with that link, on the library path.
if ! ldconfig -p 2>/dev/null | grep -q "libnccl.so "; then
  nccl="$(python3 - <<'PY' 2>/dev/null
import glob, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for f in sorted(glob.glob(d + "/nvidia/**/libnccl.so*", recursive=True)):
        print(f); sys.exit()
PY
)"
  [ -z "$nccl" ] && nccl="$(ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnccl.so.2$' | head -n 1)"
  if [ -n "$nccl" ]; then
    mkdir -p "$out/lib" && ln -sf "$nccl" "$out/lib/libnccl.so"
    export LD_LIBRARY_PATH="$out/lib:${LD_LIBRARY_PATH:-}" && say "nccl: $nccl"
  else
    say "nccl: no libnccl found (the NCCL checks will say so)"
  fi
fi

tests=""
for t in $CUDA_TESTS; do [ -f "tests/$t.rs" ] && tests="$tests $t"; done
if command -v cargo >/dev/null 2>&1; then
  say "build: cargo (--features cuda, release)"
  # Exported once: build.rs reruns (and recompiles every kernel) when NVCC changes.
  NVCC="$(timeout 120 scripts/install_nvcc.sh | tail -n 1)"; export NVCC
  test_args=""; for t in $tests; do test_args="$test_args --test $t"; done
  step build 300 "cargo test --release --features cuda $test_args --no-run &&
    cargo build --release --features cuda --bin fsdp && cargo bench --features cuda --bench kernels --no-run"
  test_cmd="cargo test --release --features cuda --test %s -- --nocapture --test-threads 1 %s"
  bench_cmd="cargo bench --features cuda --bench kernels"
  fsdp_bin="$root/target/release/fsdp"
elif [ -x "$bin/fsdp" ]; then
  say "build: prebuilt $bin (scripts/gpu-check.sh prepare)"
  tests=""; for t in $CUDA_TESTS; do [ -x "$bin/test-$t" ] && tests="$tests $t"; done
  test_cmd="$bin/test-%s --nocapture --test-threads 1 %s"
  bench_cmd="$bin/bench-kernels --bench"
  fsdp_bin="$bin/fsdp"
else
  say "FAIL build: no cargo here and no $bin (run 'scripts/gpu-check.sh prepare' where cargo is, carry .gpu-bin)"
  exit 1
fi
say "tests:$tests"

# Per-binary timeouts: the kernels take seconds; fsdp_cuda runs every collective at four
# world sizes, four dtypes and four sizes on CPU and GPU, then small FSDP trainings.
# (`distributed` runs only its NCCL tests: world of one, init_process_group(nccl).)
for t in $tests; do
  case "$t" in fsdp_cuda) to=150 ;; *) to=90 ;; esac
  filter=_cuda; [ "$t" = distributed ] && filter=nccl
  # shellcheck disable=SC2059
  step "test-$t" "$to" "$(printf "$test_cmd" "$t" "$filter")"
  # A test that needs two GPUs skips on a one-GPU machine (said, not failed); any other
  # skip means the driver or device was not found.
  if grep "skipping" "$out/test-$t.log" | grep -q ": one GPU"; then
    say "note test-$t: $(grep "skipping" "$out/test-$t.log" | grep -c ": one GPU") test(s) need two GPUs and skipped"
  fi
  if grep "skipping" "$out/test-$t.log" | grep -qv ": one GPU"; then
    say "FAIL test-$t: tests skipped on a GPU machine:"; grep "skipping" "$out/test-$t.log" | grep -v -m3 ": one GPU" | tee -a "$summary"; fail=1
  fi
  grep -E "^test .*($filter|nccl.*) \.\.\. (ok|FAILED)" "$out/test-$t.log" | sed 's/^/    /' >>"$summary"
done
step bench-kernels 120 "$bench_cmd"
grep -E "^BW " "$out/bench-kernels.log" | tee -a "$summary"

mkdir -p "$root/data"
[ -f "$root/data/tinyshakespeare.txt" ] || python3 -c "print('the king and queen of rome shall speak\n' * 3000)" >"$root/data/gpu-check.txt"
data="$root/data/tinyshakespeare.txt"; [ -f "$data" ] || data="$root/data/gpu-check.txt"

# compare NAME A.jsonl B.jsonl: per-step losses within relative 1e-4; PASS/FAIL with the
# worst difference.
compare() {
  local r
  r="$(python3 "$root/scripts/compare_curves.py" "$2" "$3")"
  say "$1: ${r:-FAIL (no result)}"
  case "$r" in PASS*) ;; *) fail=1 ;; esac
}

# 20-step loss curves of a small f32 model: CPU vs GPU at world size 1, then world size 4
# on one GPU (four rank threads sharing it) vs world size 1 on the GPU.
small="--data $data --steps 20 --n-layer 2 --n-embd 64 --n-head 4 --seq-len 64 --global-batch 8 --eval-every 0 --sample-len 0 --log-every 0"
for run in "cpu 1" "cuda 1" "cuda 4"; do
  set -- $run
  step "curve-$1-ws$2" 90 "\"$fsdp_bin\" train --device $1 --world-size $2 $small --metrics \"$out/curve-$1-ws$2.jsonl\""
done
compare "loss curve cpu vs cuda (f32, 20 steps)" "$out/curve-cuda-ws1.jsonl" "$out/curve-cpu-ws1.jsonl"
compare "loss curve cuda world size 4 vs 1 (one GPU)" "$out/curve-cuda-ws4.jsonl" "$out/curve-cuda-ws1.jsonl"

# One process through `fsdp launch` (torchrun variables, TCP store, NCCL world of one) vs
# the thread rank on the same GPU.
step "curve-nccl-ws1" 90 "\"$fsdp_bin\" launch --nproc-per-node 1 -- \"$fsdp_bin\" train --device cuda --world-size 1 $small --metrics \"$out/curve-nccl-ws1.jsonl\""
compare "loss curve nccl (fsdp launch, 1 process) vs threads (cuda, ws 1)" "$out/curve-nccl-ws1.jsonl" "$out/curve-cuda-ws1.jsonl"

# GPT-2 small's shape in bf16: tokens/s, MFU and peak device memory per rank.
for ws in 1 4; do
  if step "gpt2-ws$ws" 100 "\"$fsdp_bin\" train --device cuda --preset gpt2-124m --mixed-precision bf16 --world-size $ws --global-batch 8 --steps 6 --eval-every 0 --sample-len 0 --log-every 1 --data \"$data\""; then
    grep -E "^(gpu:|peak device memory)" "$out/gpt2-ws$ws.log" | sed "s/^/gpt2-124m bf16 ws=$ws: /" | tee -a "$summary"
  fi
done

say "NOT CHECKED HERE: NCCL across several GPUs or nodes (one GPU: NCCL runs at world size 1)"
say "== $( [ $fail -eq 0 ] && echo 'gpu-check passed' || echo 'gpu-check FAILED' ) in $SECONDS s (logs in $out)"
exit $fail
