"""Indices of torch.utils.data.distributed.DistributedSampler for `tests/train/sampler.rs`.

    python tests/torch_ref/make_sampler_refs.py > tests/torch_ref/sampler_refs.json

Each case: dataset length, world size, shuffle, seed, drop_last, epoch, and every rank's
`list(iter(sampler))` after `sampler.set_epoch(epoch)` (PyTorch 2.11).
"""
import json, sys
from torch.utils.data.distributed import DistributedSampler

cases = []
for n, w, shuffle, seed, drop_last, epoch in [
    (10, 4, False, 0, False, 0), (10, 4, False, 0, True, 0), (10, 3, True, 0, False, 0),
    (10, 3, True, 0, False, 1), (10, 3, True, 7, True, 2), (3, 4, True, 1, False, 0),
    (3, 4, True, 1, True, 0), (1, 5, False, 0, False, 0), (17, 1, True, 42, False, 5),
    (101, 8, True, 3, False, 9), (101, 8, True, 3, True, 9), (64, 4, True, 0, True, 0),
]:
    ranks = []
    for r in range(w):
        s = DistributedSampler(list(range(n)), num_replicas=w, rank=r, shuffle=shuffle,
                               seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        ranks.append(list(iter(s)))
    cases.append({"n": n, "world": w, "shuffle": shuffle, "seed": seed,
                  "drop_last": drop_last, "epoch": epoch, "ranks": ranks})
json.dump(cases, sys.stdout)
print()
