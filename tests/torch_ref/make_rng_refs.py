"""Reference values of PyTorch's CPU generator for `tests/nn_optim/torch_rng.rs`.

    python tests/torch_ref/make_rng_refs.py > tests/torch_ref/rng_refs.json

Made with pip torch 2.11.0 (CPU capability AVX512, whose normal_ runs the AVX2 kernel: the
AVX-512 dispatch of normal_stub is disabled in aten/src/ATen/native/cpu/DistributionKernels.cpp).
f32 values are stored as their IEEE bits (u32), f64 values as their bits (u64 as a decimal
string), so the test compares bit for bit; `torch_version` and `cpu_capability` record
where they were made.
"""
import json, math, struct
import torch, torch.nn as nn

def bits32(t):
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in t.flatten().tolist()]

def bits64(t):
    return [str(struct.unpack("<Q", struct.pack("<d", v))[0]) for v in t.flatten().tolist()]

def gen(seed):
    return torch.Generator().manual_seed(seed)

out = {
    "torch_version": torch.__version__,
    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
}

# Raw 32-bit draws: random_(int64 min, None) takes random64() = (first << 32) | second.
raw = {}
for seed in [0, 1, 5489, 2**40 + 7]:
    t = torch.empty(700, dtype=torch.int64).random_(-2**63, None, generator=gen(seed))
    v = []
    for x in t.tolist():
        x &= (1 << 64) - 1
        v += [x >> 32, x & 0xFFFFFFFF]
    raw[str(seed)] = v
out["raw_u32"] = raw

# uniform_ on f32 (24 bits of one draw) and f64 (53 bits of a 64-bit draw).
cases = []
for seed, n, lo, hi in [(0, 40, 0.0, 1.0), (3, 33, -0.0625, 0.0625), (7, 5, -2.5, 7.25),
                        (11, 17, -1.0 / math.sqrt(3), 1.0 / math.sqrt(3))]:
    g = gen(seed)
    a = torch.empty(n, dtype=torch.float32).uniform_(lo, hi, generator=g)
    b = torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=g)
    cases.append({"seed": seed, "n": n, "from": lo, "to": hi, "f32": bits32(a), "f64": bits64(b)})
out["uniform"] = cases

# normal_ on f32: sizes < 16 take the scalar Box-Muller (double, one cached sample), >= 16
# the 16-wide kernel (with the last 16 redrawn when 16 does not divide the size). Several
# calls on one generator check the cache and the order of draws.
cases = []
for seed, sizes, mean, std in [(0, [1, 1, 3, 5, 15], 0.0, 1.0),
                               (1, [16, 17, 31, 32, 100], 0.0, 1.0),
                               (2, [5, 40, 1, 7], 0.5, 0.02),
                               (3, [1000], -1.0, 3.0)]:
    g = gen(seed)
    calls = []
    for n in sizes:
        calls.append(bits32(torch.empty(n, dtype=torch.float32).normal_(mean, std, generator=g)))
    cases.append({"seed": seed, "sizes": sizes, "mean": mean, "std": std, "f32": calls})
out["normal_f32"] = cases

cases = []
for seed, sizes in [(4, [3, 20, 2]), (5, [16, 33])]:
    g = gen(seed)
    calls = [bits64(torch.empty(n, dtype=torch.float64).normal_(0.0, 1.0, generator=g)) for n in sizes]
    cases.append({"seed": seed, "sizes": sizes, "mean": 0.0, "std": 1.0, "f64": calls})
out["normal_f64"] = cases

# randperm (n < 2^32 / 20: Fisher-Yates with random() % (n - i)).
out["randperm"] = [{"seed": s, "n": n, "perm": torch.randperm(n, generator=gen(s)).tolist()}
                   for s, n in [(0, 1), (0, 10), (1, 10), (42, 100), (7, 1000)]]

# The default initializers through the global generator (torch.manual_seed), in the order
# the constructors draw; then randn for an input.
torch.manual_seed(0)
lin = nn.Linear(7, 5)
lin2 = nn.Linear(20, 3, bias=False)
emb = nn.Embedding(6, 4)
ln = nn.LayerNorm(3)
lin3 = nn.Linear(300, 2)
x = torch.randn(3, 7)
out["modules_seed0"] = {
    "linear_7_5.weight": bits32(lin.weight.detach()),
    "linear_7_5.bias": bits32(lin.bias.detach()),
    "linear_20_3_nobias.weight": bits32(lin2.weight.detach()),
    "embedding_6_4.weight": bits32(emb.weight.detach()),
    "layernorm_3.weight": bits32(ln.weight.detach()),
    "layernorm_3.bias": bits32(ln.bias.detach()),
    "linear_300_2.weight": bits32(lin3.weight.detach()),
    "linear_300_2.bias": bits32(lin3.bias.detach()),
    "randn_3_7": bits32(x),
}
json.dump(out, __import__("sys").stdout, separators=(",", ":"))
print()
