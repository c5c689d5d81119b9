#!/usr/bin/env bash
# Runs fsdp's CUDA code paths on this CPU through cuda-emu (cuda-emu/: a stand-in for
# libcuda, libcublas and libnccl that runs kernels/*.cu compiled as host C++), so they are
# exercised in CI without a GPU:
#   0. the emulator's own tests;
#   1. the CUDA variants of the test suites (kernels, layers, ops, FSDP on cuda, the
#      threads backend on device buffers, NCCL at world size 1, the C ABI with device
#      tensors and the host's stream) against the CPU; NCCL worlds of thread ranks and
#      their faults; the heartbeat naming a stopped NCCL rank process;
#   2. `fsdp train --device cuda` loss curves against `--device cpu`: world size 1, 2 ranks
#      on 2 emulated devices (peer copies), mixed precision, f64, CPU offload, processes
#      under `fsdp launch` (NCCL), CUDA graphs at 1 rank and at 2 processes.
# Stream work is deferred until something forces it (cuda-emu/src/queue.rs), so a missing
# event wait fails the checks; CUDA_EMU_SCHEDULE=eager runs work when issued instead.
# Each check prints PASS or FAIL; the script exits 1 when one failed. A test that skips its
# CUDA variant counts as a failure here (the emulated devices must be found).
#   usage: scripts/cuda-emu.sh [tests|curves]   (default: both)
# What the emulator cannot show (concurrency between streams, the device's own rounding of
# logf/expf, NCCL across ranks) is written in cuda-emu/src/lib.rs.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
what="${1:-all}"
case "$what" in all | tests | curves) ;; *) echo "usage: scripts/cuda-emu.sh [tests|curves]" >&2; exit 2 ;; esac

NVCC="$(scripts/install_nvcc.sh | tail -n 1)" || { echo "FAIL: no nvcc (scripts/install_nvcc.sh)"; exit 1; }
export NVCC
cargo build -p cuda-emu --release || { echo "FAIL: building cuda-emu"; exit 1; }
target="${CARGO_TARGET_DIR:-$root/target}"
case "$target" in /*) ;; *) target="$root/$target" ;; esac
lib="$target/cuda-emu/lib"
mkdir -p "$lib"
for n in libcuda.so libcuda.so.1 libcublas.so libcublas.so.13 libnccl.so libnccl.so.2; do
  ln -sf "$target/release/libcuda_emu.so" "$lib/$n"
done
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# CUDA_EMU_DEVICES (emulated GPUs) fixes one count for every check; by default the tests
# run with 2 and with 1, the training curves with 2.
[ -n "${CUDA_EMU_DEVICES:-}" ] && CUDA_EMU_DEVICES_SET="$CUDA_EMU_DEVICES"
export CUDA_EMU_DEVICES="${CUDA_EMU_DEVICES:-2}"
out="$target/cuda-emu"
fail=0

if [ "$what" != curves ]; then
  echo "== cuda-emu's own tests (its bf16/f16 conversions against the half crate)"
  if cargo test -q -p cuda-emu --release >"$out/emu-self.log" 2>&1; then echo "PASS cuda-emu self-tests"; else
    echo "FAIL cuda-emu self-tests (log: $out/emu-self.log)"; tail -n 15 "$out/emu-self.log"; fail=1
  fi
  # test-hooks: offload_pinned's hook that skips the end of backward's synchronization.
  # The library's tests and the C ABI crate's (capi_cuda); every cargo call here selects the
  # workspace as the test command does, so the library builds once with these features.
  # The library's tests are one binary per layer (tests/<layer>/main.rs, each test file a
  # module): the binaries that hold CUDA variants, filtered to those modules (a test named
  # `<module>::...` runs); capi_cuda is a binary of its own, run whole.
  binaries="ops nn_optim fsdp distributed serial"
  modules="kernels kernels_nn ops_device nn_device zero_size fsdp_zero_size fsdp_cuda offload_pinned mixed_precision_torch grad_scaler distributed f64_device batchnorm_device attention_sdpa_torch zero_redundancy"
  args=""; for t in $binaries; do args="$args --test $t"; done
  filters=""; for m in $modules; do filters="$filters $m::"; done
  # Two emulated GPUs (ranks spread over devices: peer copies) and one (every rank on
  # cuda:0, as on a lent H200), unless CUDA_EMU_DEVICES names one count. The one-GPU pass
  # runs without the caching allocator (FSDP_CUDA_NO_CACHING=1): every tensor ends at an
  # inaccessible page and is unmapped when freed, so out-of-bounds reads and use after free
  # fault at once.
  for devices in ${CUDA_EMU_DEVICES_SET:-2 1}; do
    log="$out/tests-$devices.log"
    nocache=0; [ "$devices" = 1 ] && nocache=1
    echo "== CUDA tests on cuda-emu ($devices emulated device(s), FSDP_CUDA_NO_CACHING=$nocache)"
    # shellcheck disable=SC2086
    if CUDA_EMU_DEVICES=$devices FSDP_CUDA_NO_CACHING=$nocache cargo test --workspace --exclude cuda-emu --features cuda,test-hooks $args -- --nocapture $filters >"$log" 2>&1 &&
      CUDA_EMU_DEVICES=$devices FSDP_CUDA_NO_CACHING=$nocache cargo test --workspace --exclude cuda-emu --features cuda,test-hooks --test capi_cuda -- --nocapture >>"$log" 2>&1; then
      ok=$(grep -c '_cuda \.\.\. ok\|nccl.* \.\.\. ok' "$log")
      one=$(grep "skipping" "$log" | grep -c ": one GPU")
      if [ "$one" -gt 0 ]; then
        echo "PASS cuda tests, $devices device(s): $((ok - one)) CUDA variants ok, $one skipped (needs two GPUs)"
      else
        echo "PASS cuda tests, $devices device(s): $ok CUDA variants ok"
      fi
    else
      echo "FAIL cuda tests, $devices device(s) (log: $log):"; grep -E "FAILED|panicked|cuda-emu:" "$log" | head -n 20; fail=1
    fi
    # A skip for want of a driver or device means the emulator was not found; a test that
    # needs two GPUs may skip on one.
    if grep "skipping" "$log" | grep -qv ": one GPU"; then
      echo "FAIL cuda tests: CUDA variants skipped on the emulator:"; grep "skipping" "$log" | grep -v ": one GPU" | head -n 5; fail=1
    fi
  done
  # NCCL communicators of several thread ranks need a device per rank (NCCL's own rule;
  # tests/distributed/distributed/nccl_world.rs): worlds of 2 and 4 on 4 emulated devices.
  log="$out/tests-nccl-4.log"
  echo "== NCCL worlds of 2 and 4 thread ranks on cuda-emu (4 emulated devices)"
  if CUDA_EMU_DEVICES=4 cargo test --workspace --exclude cuda-emu --features cuda,test-hooks --test distributed nccl_ -- --nocapture >"$log" 2>&1; then
    echo "PASS nccl worlds: $(grep -c 'nccl.* \.\.\. ok' "$log") tests ok"
    if grep -q "skipping" "$log"; then
      echo "FAIL nccl worlds: skipped on 4 emulated devices:"; grep "skipping" "$log" | head -n 3; fail=1
    fi
  else
    echo "FAIL nccl worlds (log: $log):"; grep -E "FAILED|panicked|cuda-emu:" "$log" | head -n 20; fail=1
  fi
  # The heartbeat on the nccl backend: 2 rank processes on 2 emulated devices (NCCL's rule
  # of one GPU per rank), rank 1 stopped with SIGSTOP under
  # --heartbeat-timeout 2 --timeout 200; rank 0 names it within seconds
  # (crates/fsdp-cli/tests/cli/waits.rs).
  log="$out/tests-nccl-heartbeat.log"
  echo "== the heartbeat on NCCL: a stopped rank process named by its peer"
  if CUDA_EMU_DEVICES=2 cargo test --workspace --exclude cuda-emu --features cuda,test-hooks --test cli waits::nccl_ -- --nocapture >"$log" 2>&1; then
    if grep -q "skipping" "$log" || ! grep -q 'nccl.* \.\.\. ok' "$log"; then
      echo "FAIL nccl heartbeat: not run on the emulator:"; grep "skipping" "$log" | head -n 3; fail=1
    else
      echo "PASS nccl heartbeat: $(grep -m1 'rank 0 ended' "$log")"
    fi
  else
    echo "FAIL nccl heartbeat (log: $log):"; grep -E "FAILED|panicked|cuda-emu:" "$log" | head -n 20; fail=1
  fi
fi

if [ "$what" != tests ]; then
  # The trainings run with seeded random stream progress (cuda-emu/src/queue.rs); the test
  # passes above with the pure deferral.
  export CUDA_EMU_SEED="${CUDA_EMU_SEED:-7}"
  echo "== fsdp train --device cuda on cuda-emu (CUDA_EMU_SEED=$CUDA_EMU_SEED)"
  # test-hooks: FSDP_FAIL_RANK for the failing NCCL rank below.
  cargo build --workspace --exclude cuda-emu --features cuda,test-hooks --bin fsdp || { echo "FAIL: building fsdp --features cuda"; exit 1; }
  fsdp="$target/debug/fsdp"
  data="$root/data/tinyshakespeare.txt"
  [ -s "$data" ] || scripts/get_data.sh >/dev/null 2>&1 || true
  if [ ! -s "$data" ]; then
    data="$out/text.txt"; python3 -c "print('the king and queen of rome shall speak\n' * 3000)" >"$data"
  fi
  small="--data $data --steps 8 --n-layer 2 --n-embd 32 --n-head 2 --seq-len 32 --global-batch 4 --eval-every 0 --sample-len 0 --log-every 0"
  run() { # run NAME ARGS...: one training, its metrics in $out/NAME.jsonl
    # (its log capped at 2 MB and its time at 10 min: a faulting kernel reports every
    # access, and a broken run may hang)
    local name="$1"; shift
    timeout 600 "$@" $small --metrics "$out/$name.jsonl" 2>&1 | head -c 2000000 >"$out/$name.log"
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
      echo "FAIL $name: $(tail -n 3 "$out/$name.log")"; fail=1
    fi
  }
  check() { # check TITLE A B [REL]
    local r; r="$(python3 scripts/compare_curves.py "$out/$2.jsonl" "$out/$3.jsonl" "${4:-1e-4}")"
    echo "$r" | sed "s/^\(PASS\|FAIL\)/\1 $1:/"
    case "$r" in PASS*) ;; *) fail=1 ;; esac
  }
  rm -f "$out"/*.jsonl
  run cpu-ws1 "$fsdp" train --device cpu --world-size 1
  run cuda-ws1 "$fsdp" train --device cuda --world-size 1
  run cpu-ws2 "$fsdp" train --device cpu --world-size 2
  run cuda-ws2 "$fsdp" train --device cuda --world-size 2
  run cpu-ws2-zero2 "$fsdp" train --device cpu --world-size 2 --strategy shard-grad-op
  run cuda-ws2-zero2 "$fsdp" train --device cuda --world-size 2 --strategy shard-grad-op
  run cpu-ws2-bf16 "$fsdp" train --device cpu --world-size 2 --mixed-precision bf16
  run cuda-ws2-bf16 "$fsdp" train --device cuda --world-size 2 --mixed-precision bf16
  run cuda-ws1-bf16 "$fsdp" train --device cuda --world-size 1 --mixed-precision bf16
  # f16 under its grad scaler (the default): the first step overflows (2^16 is beyond f16)
  # and is skipped on both; the unscale and inf check run on the device.
  run cpu-ws2-f16 "$fsdp" train --device cpu --world-size 2 --mixed-precision f16
  run cuda-ws2-f16 "$fsdp" train --device cuda --world-size 2 --mixed-precision f16
  run cuda-ws1-offload "$fsdp" train --device cuda --world-size 1 --cpu-offload
  run cuda-ws1-bf16-offload "$fsdp" train --device cuda --world-size 1 --mixed-precision bf16 --cpu-offload
  run cuda-ws2-offload "$fsdp" train --device cuda --world-size 2 --cpu-offload
  run cuda-ws2-bf16-offload "$fsdp" train --device cuda --world-size 2 --mixed-precision bf16 --cpu-offload
  run cpu-ws2-offload "$fsdp" train --device cpu --world-size 2 --cpu-offload
  run nccl-ws1 "$fsdp" launch --nproc-per-node 1 --master-port 0 -- "$fsdp" train --device cuda --world-size 1
  run nccl-ws2 "$fsdp" launch --nproc-per-node 2 --master-port 0 -- "$fsdp" train --device cuda --world-size 2
  run nccl-ws2-bf16 "$fsdp" launch --nproc-per-node 2 --master-port 0 -- "$fsdp" train --device cuda --world-size 2 --mixed-precision bf16
  # f64 (`model.double()`): the _f64 kernels against the CPU's f64 loops.
  run cpu-ws2-f64 "$fsdp" train --device cpu --world-size 2 --mixed-precision f64
  run cuda-ws2-f64 "$fsdp" train --device cuda --world-size 2 --mixed-precision f64
  run cuda-ws4 "$fsdp" train --device cuda --world-size 4
  # CUDA graphs: steps 1 and 2 eager (the second from the graph's pool), step 3 captured
  # and launched, then replays; a constant lr, and a warm-up + cosine schedule whose rate
  # the replays read from the graph's table on the device (a new rate at every step).
  run cuda-ws1-const "$fsdp" train --device cuda --world-size 1 --warmup-steps 0
  run cuda-ws1-graph "$fsdp" train --device cuda --world-size 1 --warmup-steps 0 --cuda-graphs
  run cuda-ws1-graph-accum "$fsdp" train --device cuda --world-size 1 --warmup-steps 0 --grad-accum 2 --cuda-graphs
  run cuda-ws1-accum "$fsdp" train --device cuda --world-size 1 --warmup-steps 0 --grad-accum 2
  run cuda-ws1-sched "$fsdp" train --device cuda --world-size 1 --warmup-steps 3 --lr-schedule cosine
  run cuda-ws1-graph-sched "$fsdp" train --device cuda --world-size 1 --warmup-steps 3 --lr-schedule cosine --cuda-graphs
  run nccl-ws4 "$fsdp" launch --nproc-per-node 4 --master-port 0 -- "$fsdp" train --device cuda --world-size 4
  # CUDA graphs at world size 2: each process of `fsdp launch` captures its step with its
  # NCCL collectives (the emulator records them as graph nodes, run anew at each launch);
  # the default warm-up, a new rate at every step, against nccl-ws2 above.
  run nccl-ws2-graph "$fsdp" launch --nproc-per-node 2 --master-port 0 -- "$fsdp" train --device cuda --world-size 2 --cuda-graphs
  check "cuda vs cpu, world size 1 (f32)" cuda-ws1 cpu-ws1
  check "cuda vs cpu, 2 ranks on $CUDA_EMU_DEVICES device(s) (f32)" cuda-ws2 cpu-ws2
  check "cuda vs cpu, 2 ranks, shard-grad-op" cuda-ws2-zero2 cpu-ws2-zero2
  check "cuda vs cpu, 2 ranks, bf16 mixed precision" cuda-ws2-bf16 cpu-ws2-bf16 1e-2
  check "cuda vs cpu, 2 ranks, f16 with the grad scaler" cuda-ws2-f16 cpu-ws2-f16 1e-2
  # f64 losses reach the metrics rounded to f32: equal to its rounding.
  check "cuda vs cpu, 2 ranks, f64" cuda-ws2-f64 cpu-ws2-f64 1e-6
  # CPU offload (shards in pinned host memory, the optimizer on the host): bit for bit the
  # same run without offload (the emulated kernels are the host's arithmetic), and (f32)
  # close to the CPU's offload run.
  check "cuda with cpu offload vs cuda, 1 rank" cuda-ws1-offload cuda-ws1 0
  check "cuda with cpu offload vs cuda, 1 rank, bf16" cuda-ws1-bf16-offload cuda-ws1-bf16 0
  check "cuda with cpu offload vs cuda, 2 ranks" cuda-ws2-offload cuda-ws2 0
  check "cuda with cpu offload vs cuda, 2 ranks, bf16" cuda-ws2-bf16-offload cuda-ws2-bf16 0
  check "cuda with cpu offload vs cpu with cpu offload, 2 ranks" cuda-ws2-offload cpu-ws2-offload
  check "nccl (fsdp launch, 1 process) vs threads, cuda" nccl-ws1 cuda-ws1
  # A replayed graph is the same kernels on the same addresses: bit for bit the eager run.
  check "cuda graphs vs eager, 1 rank" cuda-ws1-graph cuda-ws1-const 0
  check "cuda graphs vs eager, 1 rank, 2 micro-batches" cuda-ws1-graph-accum cuda-ws1-accum 0
  check "cuda graphs vs eager, 1 rank, warm-up + cosine lr" cuda-ws1-graph-sched cuda-ws1-sched 0
  check "cuda graphs vs eager, 2 processes (fsdp launch, nccl), lr warm-up" nccl-ws2-graph nccl-ws2 0
  # The emulated NCCL reduces in rank order in f64 as the threads backend does: bit for bit.
  check "nccl (fsdp launch, 2 processes) vs threads, cuda" nccl-ws2 cuda-ws2 0
  check "nccl (fsdp launch, 2 processes) vs threads, cuda, bf16" nccl-ws2-bf16 cuda-ws2-bf16 0
  check "nccl (fsdp launch, 4 processes on $CUDA_EMU_DEVICES devices) vs threads, cuda" nccl-ws4 cuda-ws4 0
  # A rank that fails mid-training under NCCL: one line naming it, and no hang.
  start=$SECONDS
  if FSDP_FAIL_RANK=1:3 timeout 120 "$fsdp" launch --nproc-per-node 2 --master-port 0 -- "$fsdp" train --device cuda --world-size 2 $small >"$out/nccl-fail.log" 2>&1; then
    echo "FAIL nccl failing rank: the job succeeded"; fail=1
  elif grep -q "error: fsdp launch: rank 1 failed" "$out/nccl-fail.log"; then
    echo "PASS nccl failing rank: named in $((SECONDS - start)) s: $(grep -m1 'rank 1 failed' "$out/nccl-fail.log")"
  else
    echo "FAIL nccl failing rank: $(tail -n 3 "$out/nccl-fail.log")"; fail=1
  fi
  # What a step asks of the host (backend::counters, in the metrics file), from step 2 on:
  # no host-blocking synchronization on a step that reads nothing back (with --log-every 0
  # only the first and last steps read their losses), at most one per rank on one that
  # does; and no device allocation on any step, the reading one included (FSDP's buffers
  # are kept from step to step, the caching allocator serves everything else), nor a new
  # FSDP buffer, nor a pinned host one. A change that makes a step wait for the device, or
  # ask the driver for memory, fails here. Under CPU offload (`offload` 1) each rank's host
  # waits once a step, at the end of backward, for the gradient shards' copies to the host
  # (pinned: the copies themselves are asynchronous) before the CPU optimizer reads them:
  # at most one per rank between reads, two on the reading step.
  # With a launch budget (the f32 runs of the 2-layer GPT above, at 1 and 2 ranks): at most
  # that many kernel launches (cuBLAS calls included) per rank per quiet step, the fused
  # kernels' count (docs/cuda.md, "Kernel launches per step": 147 before them, 100 after).
  counters() { # counters NAME RANKS [offload] [max launches per rank per quiet step]
    python3 - "$out/$1.jsonl" "$2" "$1" "${3:-0}" "${4:-0}" <<'PY'
import json, sys
path, ranks, name, offload = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
budget = int(sys.argv[5])
recs = [json.loads(l) for l in open(path)]
last = recs[-1]["step"] if recs else 0
quiet = [r["counters"]["host_syncs"] for r in recs[1:] if r["step"] != last]
read = [r["counters"]["host_syncs"] for r in recs[1:] if r["step"] == last]
c = lambda r, k: r["counters"].get(k, 0)
allocs = [c(r, "device_allocs") + c(r, "fsdp_buffer_allocs") + c(r, "pinned_allocs") for r in recs[1:]]
ok_syncs = bool(quiet) and max(quiet) <= offload * ranks and max(read) <= (1 + offload) * ranks
ok = ok_syncs and bool(allocs) and max(allocs) == 0
launches = ""
if budget:
    # Threads ranks share the process's counter, read at rank 0's step boundaries: another
    # rank's launches fall into one step's window or the next, so the bound is on the mean
    # over the quiet steps, per rank.
    per_step = [c(r, "kernel_launches") for r in recs[1:] if r["step"] != last]
    mean = sum(per_step) / max(len(per_step), 1) / ranks
    ok = ok and bool(per_step) and mean <= budget
    launches = f"; kernel launches per quiet step {per_step}, {mean:.1f} per rank (at most {budget})"
print(f"{'PASS' if ok else 'FAIL'} counters {name}: host syncs per step {quiet} between reads "
      f"(at most {offload * ranks}), {read} on the last step (at most {(1 + offload) * ranks}); "
      f"device + FSDP buffer + pinned allocations from step 2 {allocs} (0 each){launches}")
sys.exit(0 if ok else 1)
PY
    [ $? -eq 0 ] || fail=1
  }
  counters cuda-ws1 1 0 100
  counters cuda-ws2 2 0 100
  counters cuda-ws2-zero2 2
  counters cuda-ws2-bf16 2
  counters cuda-ws2-f64 2
  counters cuda-ws4 4
  counters cuda-ws1-offload 1 1
  counters cuda-ws1-bf16-offload 1 1
  counters cuda-ws2-offload 2 1
  counters cuda-ws2-bf16-offload 2 1
  # --cuda-graphs: one graph launch and no kernel launch from the host on every replayed
  # step (4 on), none on the eager ones; no device allocation once the graph is captured
  # (at world size 2: rank 0's process, its collectives inside the graph).
  for name in cuda-ws1-graph cuda-ws1-graph-accum cuda-ws1-graph-sched nccl-ws2-graph; do
    python3 - "$out/$name.jsonl" "$name" <<'PY' || fail=1
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
c = lambda r, k: r["counters"].get(k, 0)
graphs = [c(r, "graph_launches") for r in recs]
kernels = [c(r, "kernel_launches") for r in recs]
allocs = [c(r, "device_allocs") for r in recs[3:]]
ok = len(recs) == 8 and graphs == [0, 0] + [1] * 6 and max(kernels[3:]) == 0 and max(allocs) == 0
print(f"{'PASS' if ok else 'FAIL'} counters {sys.argv[2]}: graph launches per step {graphs}, "
      f"kernel launches {kernels} (0 from step 4), device allocations from step 4 {allocs}")
sys.exit(0 if ok else 1)
PY
  done
  # NCCL (fsdp launch, rank 0's process): no host wait (the watchdog thread watches each
  # collective) and no store request on a step that reads nothing back, and no device
  # allocation from step 2 on, the reading step included. The last step reads the losses
  # back and runs the bookkeeping collectives (host tensors through the GPU: a copy back
  # each). World size 4 is reported: 4 processes on 2 cores can make a collective slow
  # enough (> 1 s) to publish its count, as it should. The watchdog is quiet
  # (nccl/watchdog.rs): at most 50 event queries (cuEventQuery) on each quiet step, and at
  # most 50 per step over the whole run (the host runs ahead, so most polls of the queued
  # steps land in the last, reading step); it made 507-711 per step over the run before.
  for name in nccl-ws2 nccl-ws4; do
    python3 - "$out/$name.jsonl" "$name" <<'PY' || { [ "$name" = nccl-ws2 ] && fail=1; }
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
quiet = recs[1:-1]
syncs = [r["counters"]["host_syncs"] for r in quiet]
ops = [r["counters"]["store_ops"] for r in quiet]
allocs = [r["counters"]["device_allocs"] + r["counters"]["fsdp_buffer_allocs"] for r in recs[1:]]
queries = [r["counters"]["event_queries"] for r in recs]
per_step = sum(queries) / max(len(recs), 1)
ok = bool(quiet) and max(syncs) == 0 and max(ops) == 0 and max(allocs) == 0
ok = ok and max(queries[1:-1]) <= 50 and per_step <= 50
print(f"{'PASS' if ok else 'FAIL'} counters {sys.argv[2]}: host syncs {syncs}, store ops {ops} per step between reads; "
      f"device + FSDP buffer allocations from step 2 {allocs}; event queries {queries[1:-1]} per step "
      f"between reads (at most 50; step 1: {queries[0]}, last step: {queries[-1]}), "
      f"{per_step:.0f} per step over the run (at most 50)")
sys.exit(0 if ok else 1)
PY
  done
fi

echo "== cuda-emu: $([ $fail -eq 0 ] && echo passed || echo FAILED) (logs in $out)"
exit $fail
