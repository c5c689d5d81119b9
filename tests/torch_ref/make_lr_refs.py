"""Learning rates of torch.optim.lr_scheduler for `tests/nn_optim/lr_scheduler.rs`.

    python tests/torch_ref/make_lr_refs.py > tests/torch_ref/lr_refs.json

Each case: the scheduler, its arguments, the base lr of each of two parameter groups, and
`optimizer.param_groups[g]["lr"]` before the first step and after each `scheduler.step()`
(epochs 0..n), as PyTorch 2.11 computes them (f64).

`groups_*`: an optimizer over two parameters in two groups (their own lr and weight decay,
nanoGPT's decay / no-decay split) stepped 4 times with fixed gradients under a LinearLR
warm-up; the parameters after each step as f32 values.
"""
import json, math, sys, warnings
import torch
from torch.optim import SGD
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR, StepLR

warnings.filterwarnings("ignore")

def run(make, n, base=(0.1, 0.03)):
    p = [torch.nn.Parameter(torch.zeros(1)) for _ in base]
    opt = SGD([{"params": [q], "lr": b} for q, b in zip(p, base)], lr=base[0])
    sched = make(opt)
    lrs = [[g["lr"] for g in opt.param_groups]]
    for _ in range(n):
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return {"base": list(base), "lrs": lrs}

cases = {
    "linear_warmup_5": (lambda o: LinearLR(o, start_factor=0.2, end_factor=1.0, total_iters=4), 10),
    "linear_decay": (lambda o: LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=7), 10),
    "cosine_10": (lambda o: CosineAnnealingLR(o, T_max=10, eta_min=0.001), 12),
    "cosine_1": (lambda o: CosineAnnealingLR(o, T_max=1, eta_min=0.0), 3),
    "step_3": (lambda o: StepLR(o, step_size=3, gamma=0.5), 10),
    # nanoGPT-like: linear warm-up over 4 steps, then a cosine to base/10 over 9 more.
    "warmup_cosine": (lambda o: SequentialLR(o, [LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=3),
                                                 CosineAnnealingLR(o, T_max=9, eta_min=0.01)],
                                             milestones=[4]), 13),
}
out = {"torch_version": torch.__version__}
for name, (make, n) in cases.items():
    out[name] = run(make, n)
def groups_run(kind):
    w = torch.nn.Parameter(torch.tensor([[0.5, -1.25], [2.0, 0.0]]))
    b = torch.nn.Parameter(torch.tensor([-0.3, 0.7]))
    groups = [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0, "lr": 0.05}]
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95))
    elif kind == "adam":
        opt = torch.optim.Adam(groups, lr=0.01)
    else:
        opt = torch.optim.SGD(groups, lr=0.01, momentum=0.9)
    sched = LinearLR(opt, start_factor=0.5, end_factor=1.0, total_iters=2)
    grads = [([[0.1, -0.2], [0.3, 0.0]], [1.5, -0.5]), ([[-0.05, 0.4], [0.1, 0.2]], [-1.0, 0.25]),
             ([[0.3, 0.3], [-0.2, -0.1]], [0.5, 0.5]), ([[0.0, 1.0], [-1.0, 0.5]], [0.1, -0.1])]
    steps = []
    for gw, gb in grads:
        w.grad = torch.tensor(gw); b.grad = torch.tensor(gb)
        opt.step(); sched.step()
        steps.append({"w": w.detach().flatten().tolist(), "b": b.detach().tolist(),
                      "lrs": [g["lr"] for g in opt.param_groups]})
    return steps

for kind in ["adamw", "adam", "sgd"]:
    out["groups_" + kind] = groups_run(kind)
json.dump(out, sys.stdout, indent=1)
print()
