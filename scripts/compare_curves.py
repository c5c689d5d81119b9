#!/usr/bin/env python3
"""Compares the per-step losses of two `fsdp train --metrics` files.

usage: compare_curves.py A.jsonl B.jsonl [REL]

Prints one line, PASS when every step's loss of A is within relative REL (default 1e-4)
of B's and both have the same number of steps, FAIL otherwise, with the worst step.
Exit status 0 on PASS, 1 on FAIL. Used by scripts/gpu-check.sh and scripts/cuda-emu.sh.
"""
import json
import os
import sys


def losses(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line)["loss"] for line in open(path) if line.strip()]


def main():
    if len(sys.argv) not in (3, 4):
        print(__doc__.strip().splitlines()[2])
        return 2
    a, b = losses(sys.argv[1]), losses(sys.argv[2])
    tol = float(sys.argv[3]) if len(sys.argv) == 4 else 1e-4
    if not a or len(a) != len(b):
        print(f"FAIL steps {len(a)} vs {len(b)}")
        return 1
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]
    worst = max(range(len(a)), key=lambda i: rel[i])
    ok = rel[worst] <= tol
    print(
        f"{'PASS' if ok else 'FAIL'} worst relative difference {rel[worst]:.2e} at step "
        f"{worst + 1} ({a[worst]:.6f} vs {b[worst]:.6f}; first {a[0]:.4f}, last {a[-1]:.4f})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
