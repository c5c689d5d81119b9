#!/usr/bin/env bash
# One command for a lent GPU: the CUDA tests, the kernel benchmarks, CPU-vs-GPU and
# world-size loss curves, and `fsdp train --device cuda --preset gpt2-124m` throughput (tokens/s,
# MFU, peak memory, exposed communication, per-step host syncs/allocations/launches),
# with a summary under $OUT when set. Whole run bounded by BUDGET_S (default 450 s, well
# inside 8 minutes): every step gets at most its own timeout and what is left of the
# budget; steps that no longer fit are reported SKIPPED.
#
#   scripts/gpu-check.sh prepare   # here (no GPU needed): build everything with
#                                  # --features cuda (release) into .gpu-bin/ (ignored),
#                                  # for a GPU machine without cargo; carry .gpu-bin there
#   scripts/gpu-check.sh           # on the GPU machine: run .gpu-bin/ when it is there
#                                  # (the lent machine reaches no network, so cargo could
#                                  # not fetch crates or nvcc), else build with cargo;
#                                  # exit 1 when a check failed
#
# Each step has its own timeout; a step that fails is reported and the rest still run.
# What is not checked on one GPU is listed under NOT CHECKED HERE in the summary.
# Settings (environment): OUT (summary and logs; default target/gpu-check), BUDGET_S,
# GPU_CHECK_BUILD=cargo (build with cargo even when .gpu-bin/ is there). Rehearsal knobs,
# for running this script on the CPU through cuda-emu (scripts/cuda-emu.sh) before a GPU is
# lent, left unset on the GPU:
#   GPU_CHECK_MODEL          model arguments of the two throughput runs (default
#                            "--preset gpt2-124m"; e.g. "--n-layer 2 --n-embd 64 --n-head 4
#                            --seq-len 64" on the emulator, where GPT-2 small is far too slow)
#   GPU_CHECK_TIMEOUT_SCALE  integer factor on every step's own timeout (default 1)
set -uo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
bin="$root/.gpu-bin"
# Test binaries with CUDA variants (`*_cuda` tests); missing ones are skipped, so a test
# file another branch adds (the nn layers on device) is picked up once it exists.
CUDA_TESTS="kernels kernels_nn ops_device nn_device zero_size fsdp_zero_size fsdp_cuda distributed f64_device"

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
  # cargo's messages (JSON) on stdout, its errors on stderr, shown.
  for t in $CUDA_TESTS; do
    if [ ! -f "tests/$t.rs" ]; then echo "prepare: no tests/$t.rs, skipped"; continue; fi
    exe="$(cargo test --release --features cuda --test "$t" --no-run --message-format=json | exe_of test)"
    [ -x "$exe" ] || { echo "prepare: no executable for tests/$t.rs" >&2; exit 1; }
    cp "$exe" "$bin/test-$t"
  done
  exe="$(cargo bench --features cuda --bench kernels --no-run --message-format=json | exe_of bench)"
  [ -x "$exe" ] || { echo "prepare: no executable for benches/kernels.rs" >&2; exit 1; }
  cp "$exe" "$bin/bench-kernels"
  cargo build --release --features cuda --bin fsdp
  cp target/release/fsdp "$bin/fsdp"
  strip "$bin"/* || true
  # What it was built from, for the summary (the GPU machine may have no git).
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- src crates kernels tests benches Cargo.toml Cargo.lock 2>/dev/null || echo ' + uncommitted changes'), prepared $(date -u +%FT%TZ)" >"$bin/PREPARED"
  du -sh "$bin"
  echo "prepared $bin: carry it (run's carry: [\".gpu-bin\"]) and run scripts/gpu-check.sh there"
  exit 0
fi

out="${OUT:-$root/target/gpu-check}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
tmp="$(mktemp -d)"  # the libnccl.so link and a generated corpus: not results, kept out of $out
trap 'rm -rf "$tmp"' EXIT
fail=0
budget="${BUDGET_S:-450}"
scale="${GPU_CHECK_TIMEOUT_SCALE:-1}"
model="${GPU_CHECK_MODEL:---preset gpt2-124m}"
say() { echo "$*" | tee -a "$summary"; }
step() { # step NAME TIMEOUT_S 'SHELL COMMAND': runs, logs to $out/NAME.log, records PASS/FAIL
  local name="$1" t="$2" cmd="$3"
  local left=$((budget - SECONDS))
  if [ "$left" -lt 15 ]; then say "SKIPPED $name (time budget of $budget s spent)"; fail=1; return 1; fi
  t=$((t * scale))
  [ "$t" -gt "$left" ] && t="$left"
  local start=$SECONDS
  # -k: a process that ignores TERM (stuck in the driver) is killed 10 s later.
  timeout -k 10 "$t" bash -c "$cmd" >"$out/$name.log" 2>&1
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

# on_lib_path NAME: a file NAME in a folder of LD_LIBRARY_PATH (searched before ldconfig's).
on_lib_path() {
  local d IFS=:
  for d in ${LD_LIBRARY_PATH:-}; do [ -n "$d" ] && [ -e "$d/$1" ] && return 0; done
  return 1
}
# in_ldconfig PATTERN: ldconfig's cache lists a library matching PATTERN. (Not `| grep -q`:
# under pipefail, ldconfig killed by SIGPIPE when grep stops early would read as not found.)
in_ldconfig() { ldconfig -p 2>/dev/null | grep -E "$1" >/dev/null; }
# pip_lib GLOB: the first file matching GLOB under nvidia/ of python3's site-packages and
# path (CUDA's pip wheels, which the image's PyTorch ships), or in /usr/local/cuda.
pip_lib() {
  python3 - "$1" <<'PY' 2>/dev/null
import glob, site, sys
dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path[1:]
for d in dict.fromkeys(dirs):
    for f in sorted(glob.glob(d + "/nvidia/**/" + sys.argv[1], recursive=True)):
        print(f); sys.exit()
for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
    for f in sorted(glob.glob(d + "/" + sys.argv[1])):
        print(f); sys.exit()
PY
}

# cuBLAS (cudarc opens libcublas.so, .so.13 or .so.12) when neither the library path nor
# ldconfig has it.
if ! on_lib_path libcublas.so && ! on_lib_path libcublas.so.13 && ! on_lib_path libcublas.so.12 &&
  ! in_ldconfig 'libcublas\.so'; then
  f="$(pip_lib 'libcublas.so*')"
  if [ -n "$f" ]; then
    export LD_LIBRARY_PATH="${f%/*}:${LD_LIBRARY_PATH:-}" && say "cublas: ${f%/*}"
  else
    say "cublas: no libcublas found (the GEMM checks will say so)"
  fi
fi

# NCCL (nvidia-nccl-cu13/cu12 ship libnccl.so.2 only; cudarc opens libnccl.so, not .so.2):
# a folder with that link, on the library path.
if ! on_lib_path libnccl.so && ! in_ldconfig 'libnccl\.so '; then
  nccl="$(pip_lib 'libnccl.so*')"
  [ -z "$nccl" ] && nccl="$(ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnccl\.so\.2$' | head -n 1)"
  if [ -n "$nccl" ]; then
    ln -sf "$nccl" "$tmp/libnccl.so"
    export LD_LIBRARY_PATH="$tmp:${LD_LIBRARY_PATH:-}" && say "nccl: $nccl"
  else
    say "nccl: no libnccl found (the NCCL checks will say so)"
  fi
fi

tests=""
for t in $CUDA_TESTS; do [ -f "tests/$t.rs" ] && tests="$tests $t"; done
if [ -x "$bin/fsdp" ] && [ "${GPU_CHECK_BUILD:-}" != cargo ]; then
  say "build: prebuilt $bin ($(cat "$bin/PREPARED" 2>/dev/null || echo 'no PREPARED stamp'); scripts/gpu-check.sh prepare)"
  tests=""; for t in $CUDA_TESTS; do [ -x "$bin/test-$t" ] && tests="$tests $t"; done
  test_cmd="$bin/test-%s --nocapture --test-threads 1 %s"
  bench_cmd="$bin/bench-kernels --bench"
  fsdp_bin="$bin/fsdp"
elif command -v cargo >/dev/null 2>&1; then
  say "build: cargo (--features cuda, release)"
  # Exported once: crates/fsdp-core/build.rs reruns (and recompiles every kernel) when NVCC changes.
  NVCC="$(timeout 120 scripts/install_nvcc.sh | tail -n 1)"; export NVCC
  test_args=""; for t in $tests; do test_args="$test_args --test $t"; done
  step build 300 "cargo test --release --features cuda $test_args --no-run &&
    cargo build --release --features cuda --bin fsdp && cargo bench --features cuda --bench kernels --no-run"
  test_cmd="cargo test --release --features cuda --test %s -- --nocapture --test-threads 1 %s"
  bench_cmd="cargo bench --features cuda --bench kernels"
  fsdp_bin="$root/target/release/fsdp"
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
  skips="$(grep "skipping" "$out/test-$t.log")"
  one="$(grep ": one GPU" <<<"$skips")"; other="$(grep -v ": one GPU" <<<"$skips")"
  if [ -n "$one" ]; then
    say "note test-$t: $(wc -l <<<"$one") test(s) need two GPUs and skipped"
    sed 's/^.*skipping/    skipping/' <<<"$one" >>"$summary"
  fi
  if [ -n "$other" ]; then
    say "FAIL test-$t: tests skipped on a GPU machine:"; head -n 3 <<<"$other" | tee -a "$summary"; fail=1
  fi
  # One line per test run; with --nocapture a test's own output (a skip notice, a panic)
  # comes between "test NAME ... " and its result, which is put back on the NAME's line.
  results="$(awk '
    /^test .* \.\.\. / { i = index($0, " ... "); name = substr($0, 6, i - 6); r = substr($0, i + 5)
      if (r ~ /^(ok|FAILED|ignored)$/) print "test " name " ... " r; else pending = name; next }
    pending != "" && /^(ok|FAILED|ignored)$/ { print "test " pending " ... " $0; pending = "" }
    END { if (pending != "") print "test " pending " ... no result (killed?)" }' "$out/test-$t.log")"
  if [ -z "$results" ]; then
    say "FAIL test-$t: no test matching '$filter' ran"; fail=1
  else
    say "test-$t: $(grep -c ' \.\.\. ok$' <<<"$results") of $(wc -l <<<"$results") tests ok ($(grep -c . <<<"$skips") of them skipped)"
    sed 's/^/    /' <<<"$results" >>"$summary"
  fi
  # What a failed test said (the panic's place and message), which the tail above misses.
  grep -A1 "panicked at" "$out/test-$t.log" | grep -v '^--$' | head -n 6 | sed 's/^/    /' >>"$summary"
done
step bench-kernels 120 "$bench_cmd"
grep -E "^BW " "$out/bench-kernels.log" | tee -a "$summary"
# The benchmark returns 0 when it found no GPU (it says "skipping") or a kernel failed.
if ! grep -E "^BW " "$out/bench-kernels.log" >/dev/null || grep -E "^BW .* failed: |^skipping|^kernel benchmarks at" "$out/bench-kernels.log" >/dev/null; then
  say "FAIL bench-kernels: no bandwidth table, or a kernel failed:"
  grep -E "^BW .* failed: |^skipping|^kernel benchmarks at" "$out/bench-kernels.log" | head -n 3 | tee -a "$summary"
  fail=1
fi

# data/ is ignored by git, so it does not travel to a lent machine: a generated corpus there.
data="$root/data/tinyshakespeare.txt"
if [ ! -s "$data" ]; then
  data="$tmp/gpu-check.txt"
  python3 -c "print('the king and queen of rome shall speak\n' * 3000)" >"$data"
fi
say "data: $data ($(wc -c <"$data") bytes)"

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

# A CUDA-graph step (--cuda-graphs: step 3 captured, later steps replayed) vs the same run
# eager (a constant lr: no warm-up), and its counters: one graph launch and no kernel
# launch per replayed step.
for g in "" "--cuda-graphs"; do
  name="curve-cuda-const${g:+-graph}"
  step "$name" 90 "\"$fsdp_bin\" train --device cuda --world-size 1 --warmup-steps 0 $g $small --metrics \"$out/$name.jsonl\""
done
compare "loss curve cuda graphs vs eager (ws 1)" "$out/curve-cuda-const-graph.jsonl" "$out/curve-cuda-const.jsonl"
say "cuda graphs: graph/kernel launches per step $(python3 -c 'import json,sys; r=[json.loads(l)["counters"] for l in open(sys.argv[1])]; print([(c.get("graph_launches",0), c["kernel_launches"]) for c in r])' "$out/curve-cuda-const-graph.jsonl" 2>&1)"
# The same with a warm-up + cosine schedule: each replay reads its rate from the graph's
# table on the device.
for g in "" "--cuda-graphs"; do
  name="curve-cuda-sched${g:+-graph}"
  step "$name" 90 "\"$fsdp_bin\" train --device cuda --world-size 1 --warmup-steps 3 --lr-schedule cosine $g $small --metrics \"$out/$name.jsonl\""
done
compare "loss curve cuda graphs vs eager, warm-up + cosine lr (ws 1)" "$out/curve-cuda-sched-graph.jsonl" "$out/curve-cuda-sched.jsonl"
# CUDA graphs with NCCL collectives inside (each process of `fsdp launch` captures its step):
# 2 processes where two GPUs are found (NCCL puts one rank per GPU), else 1 (a world of one:
# its collectives are captured all the same), against the same launch eager.
ngpu="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"; np=1; [ "${ngpu:-0}" -ge 2 ] && np=2
for g in "" "--cuda-graphs"; do
  name="curve-nccl-eager-ws$np"; [ -n "$g" ] && name="curve-nccl-graph-ws$np"
  step "$name" 90 "\"$fsdp_bin\" launch --nproc-per-node $np -- \"$fsdp_bin\" train --device cuda --world-size $np $g $small --metrics \"$out/$name.jsonl\""
done
compare "loss curve cuda graphs vs eager, nccl (fsdp launch, $np process(es))" "$out/curve-nccl-graph-ws$np.jsonl" "$out/curve-nccl-eager-ws$np.jsonl"
say "cuda graphs, nccl ws $np: graph/kernel launches per step $(python3 -c 'import json,sys; r=[json.loads(l)["counters"] for l in open(sys.argv[1])]; print([(c.get("graph_launches",0), c["kernel_launches"]) for c in r])' "$out/curve-nccl-graph-ws$np.jsonl" 2>&1)"

# GPT-2 small's shape in bf16: tokens/s, MFU and peak device memory per rank.
label="gpt2-124m"; [ "$model" = "--preset gpt2-124m" ] || label="model '$model'"
for ws in 1 4; do
  if step "gpt2-ws$ws" 100 "\"$fsdp_bin\" train --device cuda $model --mixed-precision bf16 --world-size $ws --global-batch 8 --steps 6 --eval-every 0 --sample-len 0 --log-every 1 --data \"$data\""; then
    grep -E "^(gpu:|peak device memory|exposed communication|per step from step 2)" "$out/gpt2-ws$ws.log" | sed "s/^/$label bf16 ws=$ws: /" | tee -a "$summary"
  fi
done

[ "$np" = 1 ] && say "NOT CHECKED HERE: CUDA graphs with NCCL at world size 2 (needs two GPUs)"
say "NOT CHECKED HERE: NCCL across several GPUs or nodes (one GPU: NCCL runs at world size 1)"
say "== $( [ $fail -eq 0 ] && echo 'gpu-check passed' || echo 'gpu-check FAILED' ) in $SECONDS s (logs in $out)"
exit $fail
