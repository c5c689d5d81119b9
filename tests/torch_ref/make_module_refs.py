"""PyTorch models whose parameter names, saved weights and outputs `tests/nn_optim/module_api.rs`
and `tests/ops/custom_layer.rs` reproduce with fsdp's named containers.

    python tests/torch_ref/make_module_refs.py tests/torch_ref/modules

Writes into the directory given, with `torch.manual_seed(0)` before each model:
- `residual_mlp.safetensors`: `safetensors.torch.save_file(model.state_dict(), ...)` of
  the residual MLP below (f32), and `residual_mlp_bf16.safetensors` (the same weights
  rounded to bf16);
- `transformer_blocks.safetensors`: the fourth FSDP docs example's model
  (`examples/transformer_blocks.rs`) at width 8 instead of 512 (same names);
- `nanogpt.safetensors`: a tiny nanoGPT (`model.py` of karpathy/nanoGPT, written out
  below), saved from `named_parameters()`: `save_file` refuses the tied `lm_head.weight`,
  which `named_parameters()` leaves out as the tie's second name;
- `module_refs.json`: `named_parameters()` names of every model (the seed examples at
  their real sizes too), inputs, outputs, the residual MLP's gradients of `y.sum()`, and
  the nanoGPT's logits. f32 values as printed by `tolist()` (f64 of the f32).

Made with pip torch 2.11.0 (CPU).
"""
import copy, json, math, os, sys
from collections import OrderedDict
import torch, torch.nn as nn, torch.nn.functional as F
from safetensors.torch import save_file

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
refs = {"torch_version": torch.__version__}

def names(m):
    return [n for n, _ in m.named_parameters()]

def flat(t):
    return t.detach().flatten().tolist()


class ResidualMLP(nn.Module):
    """A custom layer: gated split MLP with a residual and mean-centering.

    u = x @ w_in.T + b_in; a, g = u.split([h, h], -1); v = a * relu(g)
    y = x + (v @ w_out.T) * gate; out = y - y.mean(-1, keepdim=True)
    """
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.w_in = nn.Parameter(torch.randn(2 * h, d) / math.sqrt(d))
        self.b_in = nn.Parameter(torch.randn(2 * h) * 0.1)
        self.w_out = nn.Parameter(torch.randn(d, h) / math.sqrt(h))
        self.gate = nn.Parameter(1.0 + 0.5 * torch.randn(d))

    def forward(self, x):
        u = x @ self.w_in.T + self.b_in
        a, g = u.split([self.h, self.h], dim=-1)
        v = a * torch.relu(g)
        y = x + (v @ self.w_out.T) * self.gate
        return y - y.mean(dim=-1, keepdim=True)


torch.manual_seed(0)
mlp = nn.Sequential(OrderedDict([
    ("proj", nn.Linear(6, 8)),
    ("block1", ResidualMLP(8, 5)),
    ("act", nn.ReLU()),
    ("block2", ResidualMLP(8, 5)),
    ("head", nn.Linear(8, 3)),
]))
x = torch.randn(4, 6)
y = mlp(x)
y.sum().backward()
save_file(mlp.state_dict(), os.path.join(out_dir, "residual_mlp.safetensors"))
save_file({k: v.to(torch.bfloat16) for k, v in mlp.state_dict().items()},
          os.path.join(out_dir, "residual_mlp_bf16.safetensors"))
with torch.no_grad():
    sd = {k: v.to(torch.bfloat16).float() for k, v in mlp.state_dict().items()}

    mlp_bf16 = copy.deepcopy(mlp)
    mlp_bf16.load_state_dict(sd)
    y_bf16 = mlp_bf16(x)
refs["residual_mlp"] = {
    "names": names(mlp),
    "x_shape": list(x.shape), "x": flat(x),
    "y_shape": list(y.shape), "y": flat(y),
    "y_bf16": flat(y_bf16),
    "grads": {n: flat(p.grad) for n, p in mlp.named_parameters()},
}

# The seed examples (examples/*.rs) at their real sizes: names only.
class TransformerBlock(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w))
    def forward(self, x):
        return self.net(x)

def transformer_blocks(w, out):
    return nn.Sequential(*[TransformerBlock(w) for _ in range(4)], nn.Linear(w, out))

refs["seed_example_names"] = {
    "simple_model": names(nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 128))),
    "shard_grad_op": names(nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64))),
    "big_model": names(nn.Linear(2048, 2048)),
    "transformer_blocks": names(transformer_blocks(512, 10)),
}
torch.manual_seed(0)
tb = transformer_blocks(8, 3)
xt = torch.randn(2, 8)
save_file(tb.state_dict(), os.path.join(out_dir, "transformer_blocks.safetensors"))
refs["transformer_blocks"] = {"x": flat(xt), "y": flat(tb(xt)), "names": names(tb)}


# nanoGPT's model (bias=True, dropout 0), small.
class LayerNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

class CausalSelfAttention(nn.Module):
    def __init__(self, c, nh):
        super().__init__()
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.nh = nh
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c, c)
    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))

class Block(nn.Module):
    def __init__(self, c, nh):
        super().__init__()
        self.ln_1 = LayerNorm(c)
        self.attn = CausalSelfAttention(c, nh)
        self.ln_2 = LayerNorm(c)
        self.mlp = MLP(c)
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer, nh, c):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, c),
            wpe=nn.Embedding(block, c),
            h=nn.ModuleList([Block(c, nh) for _ in range(n_layer)]),
            ln_f=LayerNorm(c),
        ))
        self.lm_head = nn.Linear(c, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for n, p in self.named_parameters():
            if n.endswith("bias"):
                nn.init.normal_(p, std=0.02)  # non-zero, so a swapped bias shows
    def forward(self, idx):
        b, t = idx.shape
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t))
        for blk in self.transformer.h:
            x = blk(x)
        return self.lm_head(self.transformer.ln_f(x))

torch.manual_seed(0)
gpt = GPT(vocab=16, block=8, n_layer=2, nh=2, c=8)
ids = torch.randint(0, 16, (2, 5))
save_file({n: p.detach().clone().contiguous() for n, p in gpt.named_parameters()},
          os.path.join(out_dir, "nanogpt.safetensors"))
refs["nanogpt"] = {
    "config": {"vocab_size": 16, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 8},
    "names": names(gpt),
    "ids": ids.flatten().tolist(),
    "logits": flat(gpt(ids)),
}

with open(os.path.join(out_dir, "module_refs.json"), "w") as f:
    json.dump(refs, f, indent=1)
