"""Reference values for tests/fsdp/grad_scaler.rs: PyTorch 2.11's
`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` driving real FSDP1 on CPU
with gloo, under `MixedPrecision(param_dtype=f16, reduce_dtype=f32, buffer_dtype=f16)`.

Which class, and why it is the reference:
- The class is `ShardedGradScaler(device="cpu", init_scale=INIT_SCALE,
  growth_interval=GROWTH_INTERVAL)` (growth_factor 2.0, backoff_factor 0.5 by default,
  process_group the WORLD group), the class FSDP1 pairs with f16 mixed precision. On CPU
  it runs in PyTorch 2.11 as it does on GPUs, with two CPU-only branches: `unscale_`
  all-reduces `found_inf` over gloo in place (on CUDA it is the same all-reduce on the
  device), and `update` takes `_amp_update_scale_cpu_`, a Python copy of the
  `_amp_update_scale_` kernel (backoff on any inf, growth after `growth_interval` clean
  steps), without the kernel's "grow only to a finite scale" test (never reached here: the
  scales stay below 2^18). So the numbers are the ones a GPU run takes, one rank or many,
  and plain `torch.amp.GradScaler("cpu")` would give the same at one rank (ShardedGradScaler
  adds only the all-reduce and f16 gradients' permission to be unscaled).
- `found_inf` is all-reduced with gloo's default op, SUM; `update` tests `found_inf >= 1`,
  so the decision is the one an all-reduce with MAX gives (what this project's
  `ShardedGradScaler` does).

The run:
- Model, data and FSDP wrapping as tests/torch_ref/make_mixed_precision_refs.py (imported
  from it): Sequential(Linear(8, 16), GELU(), LayerNorm(16), Linear(16, 16), ReLU(),
  Linear(16, 4)) with closed-form parameters, one FSDP unit per Linear plus the root, a
  12-row closed-form batch per step split evenly over the ranks, `torch.set_num_threads(1)`.
- Cases: FULL_SHARD at world sizes 1 and 2, HYBRID_SHARD at world size 4 (2 nodes of 2
  ranks, explicit (shard, replicate) groups), each with SGD(lr=0.1, momentum=0.9) and
  Adam(lr=0.01); STEPS steps of:
      opt.zero_grad(); loss = F.mse_loss(fm(x).float(), t)
      scaler.scale(loss).backward(); scaler.unscale_(opt); fm.clip_grad_norm_(CLIP)
      scaler.step(opt); scaler.update()
  The loss is f32 (the f16 output is upcast, as in make_mixed_precision_refs.py), so the
  loss gradient `scale * 2 (out - t) / N` is computed in f32 and rounded once to f16 by the
  upcast's backward.
- INIT_SCALE = 2^17 and GROWTH_INTERVAL = 3 make the scale both grow and back off within
  the steps: the f16 backward overflows at scales 2^14 to 2^17 here (the scale sequences
  are printed when the script runs). In the hybrid cases some steps overflow on only some
  ranks' shards (printed too).
- Recorded per case: the scale each step's backward used (`get_scale()` before it), whether
  the step was skipped (the all-reduced found_inf), each rank's own found_inf before the
  all-reduce (any non-finite value in its local gradient shards: on some steps only some
  ranks overflow, so skipping on every rank alike needs the all-reduce), every rank's loss,
  the scale and growth tracker after the last update, the scaler's `state_dict()`, and the
  final full parameters (FULL_STATE_DICT on every rank; the script checks every rank holds
  the same values).

Run: PYTHONPATH=/work/torchpkg python3 tests/torch_ref/make_grad_scaler_refs.py
writes tests/torch_ref/grad_scaler_refs.json (a minute on 2 cores).
"""

import faulthandler
import json
import math
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy as SS
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_mixed_precision_refs as mpr  # noqa: E402

STEPS = 12
INIT_SCALE = 2.0**17
GROWTH_INTERVAL = 3
CLIP = 1.0
CASES = [(SS.FULL_SHARD, 1), (SS.FULL_SHARD, 2), (SS.HYBRID_SHARD, 4)]
OPTIMIZERS = mpr.OPTIMIZERS


def train(rank, world, strategy, opt_name, groups):
    fm = mpr.wrap(strategy, torch.float16, groups)
    opt = OPTIMIZERS[opt_name](fm.parameters())
    scaler = ShardedGradScaler(device="cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    rows = mpr.ROWS // world
    rec = {"scales": [], "skipped": [], "local_found_inf": [], "losses": []}
    for s in range(STEPS):
        x, t = mpr.batch(s)
        x, t = x[rank * rows : (rank + 1) * rows], t[rank * rows : (rank + 1) * rows]
        opt.zero_grad()
        loss = F.mse_loss(fm(x).float(), t)
        rec["scales"].append(scaler.get_scale())
        scaler.scale(loss).backward()
        local = any(
            p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in fm.parameters()
        )
        scaler.unscale_(opt)
        found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        fm.clip_grad_norm_(CLIP)
        scaler.step(opt)
        scaler.update()
        rec["skipped"].append(found >= 1.0)
        rec["local_found_inf"].append(local)
        rec["losses"].append(loss.item())
    rec["final_scale"] = scaler.get_scale()
    rec["final_growth_tracker"] = scaler._get_growth_tracker()
    rec["state_dict"] = scaler.state_dict()
    with FSDP.state_dict_type(fm, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        sd = fm.state_dict()
    names = [n for n, _ in mpr.model().named_parameters()]
    flat = torch.cat([sd[n].detach().float().flatten() for n in names])
    return rec, flat


def worker(rank, world, strategy, outdir):
    warnings.filterwarnings("ignore")
    faulthandler.dump_traceback_later(600, exit=True)
    torch.set_num_threads(1)
    rdzv = "file://" + os.path.join(outdir, f"rendezvous-{strategy.name}-{world}")
    dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world)
    groups = mpr.hybrid_groups(rank, world) if strategy == SS.HYBRID_SHARD else None
    out = {}
    for oname in OPTIMIZERS:
        rec, flat = train(rank, world, strategy, oname, groups)
        recs = [None] * world
        dist.all_gather_object(recs, rec)
        mpr.check_same_on_every_rank(flat, world, f"{strategy.name} w{world} {oname} parameters")
        for key in ("scales", "skipped", "final_scale", "final_growth_tracker", "state_dict"):
            if any(q[key] != rec[key] for q in recs):
                raise RuntimeError(f"{strategy.name} w{world} {oname}: ranks differ in {key}")
        case = {
            "strategy": strategy.name,
            "world": world,
            "optimizer": oname,
            "scales": rec["scales"],
            "skipped": rec["skipped"],
            "local_found_inf": [q["local_found_inf"] for q in recs],
            "losses": [q["losses"] for q in recs],
            "final_scale": rec["final_scale"],
            "final_growth_tracker": rec["final_growth_tracker"],
            "state_dict": rec["state_dict"],
            "params": [float(v) for v in flat.tolist()],
        }
        out[f"{strategy.name}/{oname}/w{world}"] = case
        if rank == 0:
            partial = sum(1 for s in range(STEPS) if len({q["local_found_inf"][s] for q in recs}) > 1)
            print(
                f"{strategy.name} w{world} {oname}: scales {[int(math.log2(v)) for v in rec['scales']]} (log2), "
                f"skipped {[int(v) for v in rec['skipped']]}, steps where only some ranks overflowed: {partial}, "
                f"losses {[round(v, 4) for v in rec['losses']]}",
                flush=True,
            )
    if rank == 0:
        with open(os.path.join(outdir, f"{strategy.name}-{world}.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, world in CASES:
            mp.spawn(worker, args=(world, strategy, tmp), nprocs=world)
            with open(os.path.join(tmp, f"{strategy.name}-{world}.json")) as f:
                cases.update(json.load(f))
    doc = {
        "torch_version": torch.__version__,
        "class": "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler(device='cpu')",
        "init_scale": INIT_SCALE,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": GROWTH_INTERVAL,
        "steps": STEPS,
        "clip_grad_norm": CLIP,
        "mixed_precision": "param_dtype=float16, reduce_dtype=float32, buffer_dtype=float16",
        "loss": "F.mse_loss(out.float(), t)",
        "sgd": "lr=0.1, momentum=0.9",
        "adam": "lr=0.01, betas=(0.9, 0.999), eps=1e-8",
        "hybrid_ranks_per_node": mpr.HYBRID_RPN[4],
        "names": list(mpr.init_params()),
        "cases": cases,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grad_scaler_refs.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print("wrote", path, os.path.getsize(path), "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
