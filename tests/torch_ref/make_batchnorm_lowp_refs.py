"""Reference values for tests/nn_optim/batchnorm_lowp.rs: PyTorch 2.11's BatchNorm1d on CPU with a
bf16 or f16 input, weight, bias and running stats (what `MixedPrecision(param_dtype,
buffer_dtype)` gives a BatchNorm1d), training and evaluation, forward and backward.

Cases (N, C, L), L = 1 meaning an (N, C) input: (7, 6, 3), (32, 8, 1), (16, 8, 5),
(3, 4, 40), (100, 6, 1), (5, 3, 17), (4, 2, 70), (6, 5, 16): L below, at and above the
16-value blocks and 32-value vectors of PyTorch's vectorized loops along L. Closed-form values, no
RNG, computed in f32 and rounded to the dtype (index tensors n, c, l; s = case index):
  x = 0.8 sin(0.37 n + 0.11 c + 0.5 l + s) + 0.3 c
  dy = 0.5 cos(0.21 n + 0.9 c + 0.3 l + s)
  weight = 1 + 0.1 sin(c), bias = 0.05 cos(c)
  running_mean = 0.1 sin(c + 1), running_var = 1 + 0.2 cos(c)
Training: `F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)`, then
backward with dy: y, the updated running stats, dx, dw, db. Evaluation with the updated
running stats: y, dx, dw, db. Values are stored as the dtype's 16-bit patterns. torch.set_num_threads(1).

Run: /work/torchenv/bin/python tests/torch_ref/make_batchnorm_lowp_refs.py
writes tests/torch_ref/batchnorm_lowp_refs.json.
"""

import json
import os

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
CASES = [(7, 6, 3), (32, 8, 1), (16, 8, 5), (3, 4, 40), (100, 6, 1), (5, 3, 17), (4, 2, 70), (6, 5, 16)]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def flat(t):
    return t.detach().contiguous().view(torch.int16).flatten().to(torch.int32).bitwise_and(0xFFFF).tolist()


def case(N, C, L, s, dtype):
    shape = (N, C, L) if L > 1 else (N, C)
    n = torch.arange(N).view(N, 1, 1).float()
    c = torch.arange(C).view(1, C, 1).float()
    l = torch.arange(L).view(1, 1, L).float()
    x = (0.8 * torch.sin(0.37 * n + 0.11 * c + 0.5 * l + s) + 0.3 * c).reshape(shape).to(dtype)
    dy = (0.5 * torch.cos(0.21 * n + 0.9 * c + 0.3 * l + s)).reshape(shape).to(dtype)
    cc = torch.arange(C).float()
    w = (1 + 0.1 * torch.sin(cc)).to(dtype)
    b = (0.05 * torch.cos(cc)).to(dtype)
    rm = (0.1 * torch.sin(cc + 1)).to(dtype)
    rv = (1 + 0.2 * torch.cos(cc)).to(dtype)
    out = {"shape": list(shape), "x": flat(x), "dy": flat(dy), "w": flat(w), "b": flat(b),
           "rm": flat(rm), "rv": flat(rv)}
    for mode in ("train", "eval"):
        xs, ws, bs = [t.clone().requires_grad_() for t in (x, w, b)]
        y = F.batch_norm(xs, rm, rv, ws, bs, training=mode == "train", momentum=0.1, eps=1e-5)
        y.backward(dy)
        out[mode] = {"y": flat(y), "dx": flat(xs.grad), "dw": flat(ws.grad), "db": flat(bs.grad)}
        if mode == "train":
            out[mode]["rm"] = flat(rm)
            out[mode]["rv"] = flat(rv)
    return out


def main():
    refs = {name: [case(*shape, s, dt) for s, shape in enumerate(CASES)] for name, dt in DTYPES.items()}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "batchnorm_lowp_refs.json")
    with open(path, "w") as f:
        json.dump({"torch_version": torch.__version__, "cases": refs}, f)
    print("wrote", path)


if __name__ == "__main__":
    main()
