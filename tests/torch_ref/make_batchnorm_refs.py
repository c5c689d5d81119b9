"""Reference values for tests/nn_optim/batchnorm.rs: PyTorch FSDP with BatchNorm1d and no
SyncBatchNorm, emulated in one process (each rank normalizes its own batch, keeps its own
running stats, and the ranks' gradients are averaged, which is what FSDP's reduce-scatter
with its pre/post division computes).

Model: Linear(4, 6) -> BatchNorm1d(6) -> ReLU -> Linear(6, 3), closed-form parameters (no
RNG); rank r's batch at step s: x[n, j] = sin(0.37 n + 0.11 j + 0.7 r + 1.3 s), 5 rows;
target t[n, k] = cos(0.2 n + 0.3 k + r + s); loss F.mse_loss (mean); SGD lr 0.1, 3 steps.
Computed in float64 so the reference is exact to ~1e-15; the Rust test compares its f32
FSDP run against it.

Run: /work/torchenv/bin/python tests/torch_ref/make_batchnorm_refs.py
writes tests/torch_ref/batchnorm_refs.json.
"""

import copy
import json
import math
import os

import torch

torch.set_default_dtype(torch.float64)

B, IN, HID, OUT, STEPS, LR = 5, 4, 6, 3, 3, 0.1


def closed(shape, a, b, k, scale):
    t = torch.empty(shape)
    if len(shape) == 1:
        for i in range(shape[0]):
            t[i] = scale * math.sin(a * i + k)
    else:
        for i in range(shape[0]):
            for j in range(shape[1]):
                t[i, j] = scale * math.sin(a * i + b * j + k)
    return t


def model():
    m = torch.nn.Sequential(
        torch.nn.Linear(IN, HID),
        torch.nn.BatchNorm1d(HID),
        torch.nn.ReLU(),
        torch.nn.Linear(HID, OUT),
    )
    with torch.no_grad():
        m[0].weight.copy_(closed((HID, IN), 0.37, 0.11, 1.0, 0.5))
        m[0].bias.copy_(closed((HID,), 0.5, 0.0, 0.3, 0.1))
        m[1].weight.copy_(1.0 + closed((HID,), 1.0, 0.0, 0.0, 0.1))
        m[1].bias.copy_(closed((HID,), 1.0, 0.0, 0.5, 0.05))
        m[3].weight.copy_(closed((OUT, HID), 0.29, 0.13, 2.0, 0.4))
        m[3].bias.copy_(closed((OUT,), 0.7, 0.0, 0.1, 0.1))
    return m


def batch(r, s):
    x = torch.tensor([[math.sin(0.37 * n + 0.11 * j + 0.7 * r + 1.3 * s) for j in range(IN)] for n in range(B)])
    t = torch.tensor([[math.cos(0.2 * n + 0.3 * k + r + s) for k in range(OUT)] for n in range(B)])
    return x, t


def run(world):
    replicas = [model() for _ in range(world)]
    losses = []
    for s in range(STEPS):
        grads = None
        step_losses = []
        for r, m in enumerate(replicas):
            m.train()
            m.zero_grad()
            x, t = batch(r, s)
            loss = torch.nn.functional.mse_loss(m(x), t)
            loss.backward()
            step_losses.append(loss.item())
            g = [p.grad.clone() for p in m.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        losses.append(step_losses)
        with torch.no_grad():
            for m in replicas:
                for p, g in zip(m.parameters(), grads):
                    p -= LR * g / world
    out = {"losses": losses, "params": {}, "buffers": []}
    for n, p in replicas[0].named_parameters():
        out["params"][n] = p.detach().flatten().tolist()
    for m in replicas:
        out["buffers"].append({n: b.detach().flatten().tolist() for n, b in m.named_buffers()})
    # Evaluation of rank 0's replica on rank 0's step-0 batch with its running stats.
    m = copy.deepcopy(replicas[0]).eval()
    with torch.no_grad():
        out["eval_out"] = m(batch(0, 0)[0]).flatten().tolist()
    return out


refs = {str(w): run(w) for w in range(1, 5)}
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "batchnorm_refs.json")
with open(path, "w") as f:
    json.dump({"torch_version": torch.__version__, "worlds": refs}, f, indent=1)
print("wrote", path)
