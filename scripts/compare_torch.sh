#!/usr/bin/env bash
# Side-by-side CPU training speed: `fsdp train` at world sizes 1, 2 and 4 (threads backend,
# FullShard) against PyTorch on the same model, batch and machine: torch_char_gpt.py plain
# (1 process, as many threads as cores) and PyTorch FSDP FULL_SHARD over gloo with 2 and 4
# processes (torchrun; cores / processes threads each). Prints tokens/s and the ratios.
#
#   scripts/compare_torch.sh [--steps S] [--config main|large|both]
#
# main:  4 layers x 128, 4 heads, seq 64, global batch 64 (the `fsdp train` defaults)
# large: 8 layers x 256, 8 heads, seq 128, global batch 64
#
# Needs PyTorch (`pip install torch`; PYTHON=... picks the interpreter, default python3)
# and tools/torch_char_gpt.py from the shared folder beside the repository (TORCH_SCRIPT=...
# overrides). Without PyTorch only the fsdp rows are printed. Tokens/s of either side count
# every step, the first included (fsdp: from the step times of --metrics; PyTorch: the
# script's own tok_s over its loop). Timings need a quiet machine: the load average is
# printed before and after.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
steps=50
configs="both"
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --config) configs="$2"; shift 2 ;;
    *) echo "usage: $0 [--steps S] [--config main|large|both]" >&2; exit 2 ;;
  esac
done
[ "$configs" = both ] && configs="main large"

scripts/get_data.sh >/dev/null
data="$root/data/tinyshakespeare.txt"
fsdp="${FSDP_BIN:-}"
if [ -z "$fsdp" ]; then
  cargo build --release --quiet
  fsdp="$root/target/release/fsdp"
fi
py="${PYTHON:-python3}"
script="${TORCH_SCRIPT:-}"
for cand in "$root/../shared/tools/torch_char_gpt.py" "$root/../../shared/tools/torch_char_gpt.py"; do
  [ -z "$script" ] && [ -f "$cand" ] && script="$cand"
done
have_torch=0
if [ -n "$script" ] && "$py" -c 'import torch' 2>/dev/null; then
  have_torch=1
else
  echo "note: PyTorch or torch_char_gpt.py not found; printing the fsdp rows only" >&2
fi
cores="$(nproc)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# fsdp_tps WORLD ARGS...: tokens/s over all steps, from the per-step times.
fsdp_tps() {
  local w="$1"; shift
  "$fsdp" train --data "$data" --world-size "$w" --steps "$steps" --eval-every 0 \
    --sample-len 0 --log-every 1000000 --metrics "$tmp/m.jsonl" "$@" >/dev/null 2>&1
  "$py" - "$tmp/m.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
secs = sum(r["step_time_s"] for r in rows)
toks = rows[0]["tokens_per_s"] * rows[0]["step_time_s"]
print(f"{toks * len(rows) / secs:.0f}")
PY
}

# torch_tps PROCS ARGS...: the script's tok_s.
torch_tps() {
  local n="$1"; shift
  local threads=$(( cores / n )); [ "$threads" -lt 1 ] && threads=1
  if [ "$n" = 1 ]; then
    "$py" "$script" "$data" --steps "$steps" --threads "$threads" "$@" 2>/dev/null
  else
    "$py" -m torch.distributed.run --standalone --nproc-per-node "$n" "$script" "$data" \
      --steps "$steps" --threads "$threads" --fsdp full "$@" 2>/dev/null
  fi | sed -n 's/.*tok_s \([0-9]*\).*/\1/p' | tail -n 1
}

ratio() { "$py" -c "import sys; a, b = sys.argv[1:]; print(f'{float(a) / float(b):.2f}x' if a and b else '-')" "$1" "$2"; }

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%F)"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-6s %-22s %12s %12s %8s\n' config run fsdp_tok/s torch_tok/s ratio
for cfg in $configs; do
  case "$cfg" in
    main) f=(--n-layer 4 --n-embd 128 --n-head 4 --seq-len 64 --global-batch 64)
          t=(--layers 4 --embd 128 --heads 4 --seq 64 --batch 64) ;;
    large) f=(--n-layer 8 --n-embd 256 --n-head 8 --seq-len 128 --global-batch 64)
           t=(--layers 8 --embd 256 --heads 8 --seq 128 --batch 64) ;;
    *) echo "unknown config $cfg" >&2; exit 2 ;;
  esac
  for w in 1 2 4; do
    a="$(fsdp_tps "$w" "${f[@]}")"
    b=""
    [ "$have_torch" = 1 ] && b="$(torch_tps "$w" "${t[@]}")"
    if [ "$w" = 1 ]; then name="W1 vs torch plain"; else name="W$w vs torch FSDP $w"; fi
    printf '%-6s %-22s %12s %12s %8s\n' "$cfg" "$name" "$a" "${b:--}" "$(ratio "$a" "$b")"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
