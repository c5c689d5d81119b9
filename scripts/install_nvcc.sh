#!/usr/bin/env bash
# Installs a CUDA 13.0 nvcc from PyPI wheels when no CUDA toolkit is found, and prints the
# path of nvcc on its last line. Idempotent: reuses an earlier install.
#   usage: scripts/install_nvcc.sh [DIR]   (default DIR: .cuda in the repository)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/.cuda}"

find_nvcc() {
  if [ -n "${NVCC:-}" ] && [ -x "${NVCC}" ]; then echo "$NVCC"; return 0; fi
  for home in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    if [ -n "$home" ] && [ -x "$home/bin/nvcc" ]; then echo "$home/bin/nvcc"; return 0; fi
  done
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return 0; fi
  if [ -x "$dir/nvidia/cu13/bin/nvcc" ]; then echo "$dir/nvidia/cu13/bin/nvcc"; return 0; fi
  return 1
}

if nvcc_path="$(find_nvcc)"; then
  echo "nvcc found: $nvcc_path" >&2
  echo "$nvcc_path"
  exit 0
fi

echo "no CUDA toolkit found; installing nvcc 13.0 from PyPI into $dir" >&2
python3 -m pip install --quiet --disable-pip-version-check --target "$dir" \
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
  nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 >&2
nvcc_path="$dir/nvidia/cu13/bin/nvcc"
if [ ! -x "$nvcc_path" ]; then
  echo "error: the wheels installed but $nvcc_path is missing" >&2
  exit 1
fi
"$nvcc_path" --version >&2
echo "$nvcc_path"
