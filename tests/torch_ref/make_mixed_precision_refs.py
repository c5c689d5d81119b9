"""Reference values for tests/fsdp/mixed_precision_torch.rs: real PyTorch FSDP1
(`torch.distributed.fsdp.FullyShardedDataParallel`) on CPU with gloo, in f32 and under
`MixedPrecision(param_dtype=bf16 | f16, reduce_dtype=f32, buffer_dtype=param_dtype)`.

How the references were made:
- PyTorch 2.11.0 (CPU wheel), gloo, one process per rank started with
  `torch.multiprocessing.spawn`, world sizes 1-4, `torch.set_num_threads(1)` in every rank
  (LayerNorm's CPU backward accumulates the weight/bias gradient in a per-thread
  low-precision buffer, so its bf16/f16 result depends on the thread count; one thread is
  the reproducible choice: one row added at a time).
- Model: Sequential(Linear(8, 16), GELU(), LayerNorm(16), Linear(16, 16), ReLU(),
  Linear(16, 4)), closed-form parameters (no RNG, see `init_params`), computed in float64
  and rounded to float32. Wrapped with `auto_wrap_policy=ModuleWrapPolicy({nn.Linear})`:
  one FSDP unit per Linear (`0`, `3`, `5`) plus the root, which holds the LayerNorm.
  `use_orig_params=False`, `device_id=cpu`, other FSDP arguments at their defaults (so the
  root casts its floating-point input to `param_dtype`, nested units do not cast).
- Hybrid strategies get explicit `(shard, replicate)` process groups laid out as this
  project's `DeviceMesh` / `hybrid_groups(world, ranks_per_node)` does: shard groups are
  `rpn` consecutive ranks, replicate groups the ranks with the same index in their shard
  group. `rpn` (`HYBRID_RPN`, also in the metadata) is 1, 2, 3, 2 at world 1, 2, 3, 4: at
  world 4 the project's usual 2 nodes x 2 ranks; at world 2 and 3 one node of `world`
  ranks, NOT the project's `hybrid_ranks_per_node` (1), because FSDP1 clamps a unit whose
  process group has one rank to NO_SHARD (`_init_core_state`: "switching to use NO_SHARD
  ... since the world size is 1"), and NO_SHARD never runs the replicate all-reduce: with
  a 1-rank shard group every rank silently trains alone (measured: the replicas'
  parameters differ after one step). That is not data parallelism, so it is no reference.
- Data: a global batch of 12 rows per step, x[n, j] = sin(0.37 n + 0.11 j + 1.3 s),
  target t[n, k] = 0.5 cos(0.2 n + 0.3 k + s) (float64 rounded to float32); rank r of W
  takes rows [r 12/W, (r+1) 12/W). Loss `F.mse_loss(out.float(), t)` (mean): the
  low-precision output is upcast for the loss because `F.mse_loss(bf16, f32)` has no
  backward in PyTorch 2.11 ("Found dtype Float but expected BFloat16"), so the loss is f32
  and its gradient is rounded once to param_dtype by the upcast's backward.
- Optimizers over `fsdp_model.parameters()` (the f32 sharded flat parameters): SGD(lr=0.1,
  momentum=0.9) and Adam(lr=0.01) (betas 0.9/0.999, eps 1e-8). 4 steps of zero_grad,
  forward, loss, backward, step.
- Recorded, per precision (f32, bf16, f16) x strategy x world x optimizer: every rank's
  loss at every step (`.../losses`, [steps, world] f32) and the final full parameters
  (`.../params`, f32, all parameters in `named_parameters()` order concatenated; names and
  shapes in the metadata), taken from a FULL_STATE_DICT on every rank (the script checks
  that every rank holds the same values). Also the initial parameters (`init/params`) and
  the batches (`data/x` [steps, 12, 8], `data/t` [steps, 12, 4]) so a consumer can check
  that it builds the same bits.
- gloo runs every collective these cases need in bf16 and f16 (all-gather of parameters,
  reduce-scatter / all-reduce of gradients, also with reduce_dtype = param_dtype) for every
  strategy at world sizes 1-4; nothing is skipped.

Run: /work/torchenv/bin/python tests/torch_ref/make_mixed_precision_refs.py
writes tests/torch_ref/mixed_precision_refs.safetensors (a few minutes on 2 cores).
"""

import faulthandler
import json
import math
import os
import sys
import tempfile
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy as SS
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

ROWS, IN, HID, OUT, STEPS = 12, 8, 16, 4, 4
STRATEGIES = [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD, SS.HYBRID_SHARD, SS._HYBRID_SHARD_ZERO2]
PRECISIONS = {"f32": None, "bf16": torch.bfloat16, "f16": torch.float16}
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}
WORLDS = [int(w) for w in os.environ.get("WORLDS", "1,2,3,4").split(",")]
HYBRID_RPN = {1: 1, 2: 2, 3: 3, 4: 2}


def closed(shape, a, b, k, scale, offset=0.0):
    """offset + scale * sin(a i + b j + k), in float64, rounded to float32."""
    t = torch.empty(shape, dtype=torch.float64)
    if len(shape) == 1:
        for i in range(shape[0]):
            t[i] = offset + scale * math.sin(a * i + k)
    else:
        for i in range(shape[0]):
            for j in range(shape[1]):
                t[i, j] = offset + scale * math.sin(a * i + b * j + k)
    return t.float()


def init_params():
    return {
        "0.weight": closed((HID, IN), 0.37, 0.11, 1.0, 0.4),
        "0.bias": closed((HID,), 0.5, 0.0, 0.3, 0.1),
        "2.weight": closed((HID,), 1.0, 0.0, 0.0, 0.1, offset=1.0),
        "2.bias": closed((HID,), 1.0, 0.0, 0.5, 0.05),
        "3.weight": closed((HID, HID), 0.29, 0.13, 2.0, 0.3),
        "3.bias": closed((HID,), 0.7, 0.0, 0.1, 0.1),
        "5.weight": closed((OUT, HID), 0.23, 0.17, 3.0, 0.3),
        "5.bias": closed((OUT,), 0.9, 0.0, 0.2, 0.1),
    }


def model():
    m = nn.Sequential(
        nn.Linear(IN, HID), nn.GELU(), nn.LayerNorm(HID), nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, OUT)
    )
    p = init_params()
    with torch.no_grad():
        for n, t in m.named_parameters():
            t.copy_(p[n])
    return m


def batch(s):
    x = torch.tensor(
        [[math.sin(0.37 * n + 0.11 * j + 1.3 * s) for j in range(IN)] for n in range(ROWS)], dtype=torch.float64
    )
    t = torch.tensor(
        [[0.5 * math.cos(0.2 * n + 0.3 * k + s) for k in range(OUT)] for n in range(ROWS)], dtype=torch.float64
    )
    return x.float(), t.float()


def hybrid_groups(rank, world):
    """(shard, replicate) groups of `HYBRID_RPN[world]` ranks per node, laid out as the
    project's DeviceMesh (shape (world / rpn, rpn), dims ("replicate", "shard"))."""
    rpn = HYBRID_RPN[world]
    shard = rep = None
    for node in range(world // rpn):
        g = dist.new_group(list(range(node * rpn, (node + 1) * rpn)))
        if rank // rpn == node:
            shard = g
    for i in range(rpn):
        g = dist.new_group(list(range(i, world, rpn)))
        if rank % rpn == i:
            rep = g
    return shard, rep


def wrap(strategy, dtype, groups):
    """The model under FSDP1 as the references wrap it: one unit per Linear plus the root,
    `MixedPrecision(param_dtype=dtype, reduce_dtype=f32, buffer_dtype=dtype)` (none for
    dtype None), the hybrid strategies over `groups`."""
    mpol = None
    if dtype is not None:
        mpol = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)
    hybrid = strategy in (SS.HYBRID_SHARD, SS._HYBRID_SHARD_ZERO2)
    return FSDP(
        model(),
        process_group=groups if hybrid else None,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=mpol,
        device_id=torch.device("cpu"),
    )


def train(rank, world, strategy, dtype, opt_name, groups):
    fm = wrap(strategy, dtype, groups)
    opt = OPTIMIZERS[opt_name](fm.parameters())
    rows = ROWS // world
    losses = []
    for s in range(STEPS):
        x, t = batch(s)
        x, t = x[rank * rows : (rank + 1) * rows], t[rank * rows : (rank + 1) * rows]
        opt.zero_grad()
        out = fm(x)
        assert out.dtype == (dtype or torch.float32), out.dtype
        loss = F.mse_loss(out.float(), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with FSDP.state_dict_type(fm, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        sd = fm.state_dict()
    names = [n for n, _ in model().named_parameters()]
    flat = torch.cat([sd[n].detach().float().flatten() for n in names])
    return losses, flat


def check_same_on_every_rank(flat, world, what):
    """Raises naming `what` and the rank unless every rank of the world holds `flat`."""
    all_flat = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(all_flat, flat)
    for r, f in enumerate(all_flat):
        if not torch.equal(f, flat):
            raise RuntimeError(f"{what}: rank {r} differs")


def worker(rank, world, outdir):
    warnings.filterwarnings("ignore")
    faulthandler.dump_traceback_later(600, exit=True)
    torch.set_num_threads(1)
    rdzv = "file://" + os.path.join(outdir, f"rendezvous{world}")
    dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world)
    groups = hybrid_groups(rank, world)
    out = {}
    for pname, dtype in PRECISIONS.items():
        for strategy in STRATEGIES:
            for oname in OPTIMIZERS:
                losses, flat = train(rank, world, strategy, dtype, oname, groups)
                all_losses = [None] * world
                dist.all_gather_object(all_losses, losses)
                check_same_on_every_rank(flat, world, f"{pname} {strategy.name} {oname} w{world}")
                key = f"{pname}/{strategy.name}/{oname}/w{world}"
                out[key + "/losses"] = np.array(all_losses, dtype=np.float32).T.copy()
                out[key + "/params"] = flat.numpy()
                if rank == 0:
                    print(key, "losses", [f"{v:.6f}" for v in all_losses[0]], flush=True)
    if rank == 0:
        np.savez(os.path.join(outdir, f"w{world}.npz"), **out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    from safetensors.numpy import save_file  # here: importing this module needs no safetensors

    tensors = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in WORLDS:
            mp.spawn(worker, args=(world, tmp), nprocs=world)
            with np.load(os.path.join(tmp, f"w{world}.npz")) as z:
                tensors.update({k: z[k] for k in z.files})
    p = init_params()
    tensors["init/params"] = torch.cat([t.flatten() for t in p.values()]).numpy()
    xs, ts = zip(*(batch(s) for s in range(STEPS)))
    tensors["data/x"] = torch.stack(xs).numpy()
    tensors["data/t"] = torch.stack(ts).numpy()
    meta = {
        "torch_version": torch.__version__,
        "names": json.dumps(list(p)),
        "shapes": json.dumps([list(t.shape) for t in p.values()]),
        "steps": str(STEPS),
        "rows": str(ROWS),
        "precisions": json.dumps(list(PRECISIONS)),
        "strategies": json.dumps([s.name for s in STRATEGIES]),
        "optimizers": json.dumps(list(OPTIMIZERS)),
        "mixed_precision": "param_dtype=<precision>, reduce_dtype=float32, buffer_dtype=<precision>",
        "loss": "F.mse_loss(out.float(), t)",
        "sgd": "lr=0.1, momentum=0.9",
        "adam": "lr=0.01, betas=(0.9, 0.999), eps=1e-8",
        "wrap": "ModuleWrapPolicy({nn.Linear}) + root",
        "threads": "1",
        "hybrid_ranks_per_node": json.dumps(HYBRID_RPN),
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mixed_precision_refs.safetensors")
    save_file(tensors, path, metadata=meta)
    print("wrote", path, os.path.getsize(path), "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
