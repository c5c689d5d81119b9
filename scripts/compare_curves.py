#!/usr/bin/env python3
"""Compares the per-step losses of two `fsdp train --metrics` files.

usage: compare_curves.py [--window W] A.jsonl B.jsonl [REL]

Prints one line, PASS when every step's loss of A is within relative REL (default 1e-4)
of B's and both have the same number of steps, FAIL otherwise, with the worst step.
With --window W the compared values are the W-step trailing means of the two curves
(steps 1..W, 2..W+1, ...), the smoothing a training dashboard applies: two runs that
follow different trajectories (another precision, another reduction order) see other
mini-batch noise at a given step, so a single step's gap measures that noise, not a bias.
Exit status 0 on PASS, 1 on FAIL. Used by scripts/gpu-check.sh, scripts/cuda-emu.sh and
scripts/bf16_curve.sh.
"""
import json
import os
import sys


def losses(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line)["loss"] for line in open(path) if line.strip()]


def trailing_means(xs, w):
    """The means of xs[i:i + w] for every full window, in order."""
    return [sum(xs[i : i + w]) / w for i in range(len(xs) - w + 1)]


def main():
    args = sys.argv[1:]
    window = 1
    if len(args) >= 2 and args[0] == "--window":
        try:
            window = int(args[1])
        except ValueError:
            window = 0
        if window < 1:
            print(f"FAIL --window must be a positive integer, got {args[1]!r}")
            return 2
        args = args[2:]
    if len(args) not in (2, 3):
        print(__doc__.strip().splitlines()[2])
        return 2
    a, b = losses(args[0]), losses(args[1])
    tol = float(args[2]) if len(args) == 3 else 1e-4
    if not a or len(a) != len(b) or len(a) < window:
        print(f"FAIL steps {len(a)} vs {len(b)} (window {window})")
        return 1
    sa, sb = trailing_means(a, window), trailing_means(b, window)
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(sa, sb)]
    worst = max(range(len(sa)), key=lambda i: rel[i])
    mean = sum(rel) / len(rel)
    ok = rel[worst] <= tol
    at = f"step {worst + 1}" if window == 1 else f"steps {worst + 1}-{worst + window}"
    print(
        f"{'PASS' if ok else 'FAIL'} worst relative difference {rel[worst]:.2e} at {at} "
        f"({sa[worst]:.6f} vs {sb[worst]:.6f}; mean {mean:.2e}; "
        f"first {a[0]:.4f}, last {a[-1]:.4f})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
