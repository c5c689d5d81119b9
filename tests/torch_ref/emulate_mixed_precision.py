"""An emulator of PyTorch 2.11 FSDP1's bf16/f16 numerics for the model of
make_mixed_precision_refs.py, and the measurements behind the tolerances of
tests/fsdp/mixed_precision_torch.rs.

The model is re-implemented op by op in float64 (or float32 with EMU32=1), rounding to
param_dtype exactly where PyTorch's CPU kernels round (tests/torch_ref/
mixed_precision_rounding.md), with FSDP's f32 reduction (pre/post division) and torch's
SGD / Adam on f32 master parameters. Against mixed_precision_refs.safetensors it prints,
per dtype, optimizer and variant, the worst deviation over the 20 strategy x world cases:
- abs: max |param - reference|
- ulpP: max |param - reference| in param_dtype ulps of max(|reference|, 1/16)
- ulpL: the same for every rank's loss at every step
- frac: fraction of a case's parameters off by more than 1/8 such ulp
Variant "exact" applies every rounding point; each other variant moves one of them
(VARIANTS below). "exact" is what f32 rounding of the same operations can change; the
others are what a moved rounding point changes.

Run: /work/torchenv/bin/python tests/torch_ref/emulate_mixed_precision.py [variant ...]
"""

import json
import math
import os
import sys

import numpy as np
import torch
from safetensors import safe_open

torch.set_num_threads(1)
D = torch.float32 if os.environ.get("EMU32") else torch.float64
REF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mixed_precision_refs.safetensors")
VARIANTS = {
    "exact": "every rounding point as PyTorch",
    "lin": "linear outputs not rounded",
    "bias2": "linear rounded after the GEMM and again after the bias",
    "gelu": "GELU output not rounded",
    "ln": "LayerNorm output not rounded",
    "ln_norm_round": "LayerNorm rounded after normalizing and after the affine",
    "ln_stats": "LayerNorm backward with f32 mean/rstd instead of the rounded saved ones",
    "ln_acc_f32": "LayerNorm weight/bias grads summed in f32, rounded once",
    "agrad": "activation gradients not rounded",
    "pgrad": "parameter gradients not rounded",
    "dout": "loss gradient not rounded",
    "input": "root input not rounded",
}


def load():
    f = safe_open(REF, "np")
    return f, f.metadata()


def run(f, meta, lp, world, opt_name, var="exact"):
    """Final f32 parameters (flat) and losses [steps, world] of one emulated case."""
    names = json.loads(meta["names"])
    shapes = json.loads(meta["shapes"])
    steps, rows_all = int(meta["steps"]), int(meta["rows"])
    xs = torch.from_numpy(f.get_tensor("data/x"))
    ts = torch.from_numpy(f.get_tensor("data/t"))
    init = torch.from_numpy(f.get_tensor("init/params"))

    def r(t, point=None):
        return t if point == var else t.to(lp).to(D)

    params, o = [], 0
    for s in shapes:
        k = int(np.prod(s))
        params.append(torch.nn.Parameter(init[o : o + k].reshape(s).clone()))
        o += k
    opt = (
        torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if opt_name == "sgd"
        else torch.optim.Adam(params, lr=0.01)
    )
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    post = world / pre
    rows = rows_all // world
    losses = []
    for s in range(steps):
        W0, b0, w2, b2, W3, b3, W5, b5 = (r(p.detach().to(D)) for p in params)
        total = None
        step_losses = []
        for k in range(world):
            x = r(xs[s, k * rows : (k + 1) * rows].to(D), "input")
            t = ts[s, k * rows : (k + 1) * rows].to(D)

            def linear(a, w, b):
                if var == "bias2":
                    return r(r(a @ w.T) + b)
                return r(a @ w.T + b, "lin")

            h1 = linear(x, W0, b0)
            g = r(torch.nn.functional.gelu(h1), "gelu")
            n = g.shape[1]
            mean = g.mean(1, keepdim=True)
            rstd = 1 / torch.sqrt(((g - mean) ** 2).mean(1, keepdim=True) + 1e-5)
            if var == "ln_norm_round":
                ln = r(r((g - mean) * rstd) * w2 + b2)
            else:
                ln = r((g - mean) * rstd * w2 + b2, "ln")
            m_s, a_s = r(mean, "ln_stats"), r(rstd, "ln_stats")
            h3 = linear(ln, W3, b3)
            a3 = torch.relu(h3)
            out = linear(a3, W5, b5)
            step_losses.append(float(torch.mean((out - t) ** 2).float()))
            # Backward.
            dout = r(2 * (out - t) / out.numel(), "dout")
            gr = [None] * 8
            gr[6], gr[7] = r(dout.T @ a3, "pgrad"), r(dout.sum(0), "pgrad")
            dh3 = r(dout @ W5, "agrad") * (h3 > 0)
            gr[4], gr[5] = r(dh3.T @ ln, "pgrad"), r(dh3.sum(0), "pgrad")
            dln = r(dh3 @ W3, "agrad")
            ds = (dln * g * w2).sum(1, keepdim=True)
            db = (dln * w2).sum(1, keepdim=True)
            bb = (db * m_s - ds) * a_s**3 / n
            c = -bb * m_s - db * a_s / n
            dg = r(a_s * dln * w2 + bb * g + c, "agrad")
            if var == "ln_acc_f32":
                gr[2] = r((dln * (a_s * g - a_s * m_s)).sum(0), "pgrad")
                gr[3] = r(dln.sum(0), "pgrad")
            else:
                acc_w, acc_b = torch.zeros(n, dtype=D), torch.zeros(n, dtype=D)
                for i in range(g.shape[0]):
                    acc_w = r(acc_w + dln[i] * (a_s[i] * g[i] - a_s[i] * m_s[i]), "pgrad")
                    acc_b = r(acc_b + dln[i], "pgrad")
                gr[2], gr[3] = acc_w, acc_b
            pdf = torch.exp(-(h1**2) / 2) / math.sqrt(2 * math.pi)
            cdf = 0.5 * (1 + torch.erf(h1 / math.sqrt(2)))
            dh1 = r((cdf + h1 * pdf) * dg, "agrad")
            gr[0], gr[1] = r(dh1.T @ x, "pgrad"), r(dh1.sum(0), "pgrad")
            # FSDP: lp grad -> f32, pre-divide, sum over ranks (f32).
            g32 = [v.float() / pre for v in gr]
            total = g32 if total is None else [a + b for a, b in zip(total, g32)]
        losses.append(step_losses)
        for p, g in zip(params, total):
            p.grad = g / post
        opt.step()
    flat = torch.cat([p.detach().float().flatten() for p in params]).numpy()
    return flat, np.array(losses, dtype=np.float32)


def ulp(v, lp):
    mant, min_exp = (7, -126) if lp == torch.bfloat16 else (10, -14)
    e = np.maximum(np.floor(np.log2(np.maximum(np.abs(v), 1e-38))), min_exp)
    return 2.0 ** (e - mant)


def main():
    f, meta = load()
    strategies = json.loads(meta["strategies"])
    variants = sys.argv[1:] or list(VARIANTS)
    for pname, lp in [("bf16", torch.bfloat16), ("f16", torch.float16)]:
        for opt in ["sgd", "adam"]:
            for var in variants:
                worst = np.zeros(4)
                for world in range(1, 5):
                    got_p, got_l = run(f, meta, lp, world, opt, var)
                    for st in strategies:
                        key = f"{pname}/{st}/{opt}/w{world}"
                        want_p, want_l = f.get_tensor(key + "/params"), f.get_tensor(key + "/losses")
                        up = np.abs(got_p - want_p) / ulp(np.maximum(np.abs(want_p), 1 / 16), lp)
                        ul = np.abs(got_l - want_l) / ulp(np.maximum(np.abs(want_l), 1 / 16), lp)
                        row = [np.abs(got_p - want_p).max(), up.max(), ul.max(), (up > 0.125).mean()]
                        worst = np.maximum(worst, row)
                print(
                    f"{pname} {opt:4} {var:14} abs {worst[0]:.2e} ulpP {worst[1]:.3f} "
                    f"ulpL {worst[2]:.3f} frac {worst[3]:.4f}   ({VARIANTS[var]})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
