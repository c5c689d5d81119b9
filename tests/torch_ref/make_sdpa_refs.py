"""Reference values for tests/ops/attention_sdpa_torch.rs: PyTorch 2.11's CPU
`F.scaled_dot_product_attention(q, k, v, is_causal=True)` on bf16 and f16 heads (the
flash-attention CPU kernel, aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), forward
and backward, on an AVX-512 CPU (its vector exponential, `exp_u20`, is the AVX-512 one).

Cases (B, H, T, hd): T multiples of 16 and not, T = 1 and T >= 192 (query blocks of 64
instead of 32), head widths 8 to 64. Closed-form inputs, no RNG, computed in f32 and
rounded to the dtype (index tensors b, h, t, d):
  q    = sin(0.37 t + 0.11 d + 0.7 h + 1.3 b)
  k    = sin(0.23 t + 0.19 d + 0.5 h + 0.9 b + 1)
  v    = 0.5 sin(0.31 t + 0.07 d + 0.3 h + 1.1 b + 2)
  dout = 0.5 cos(0.29 t + 0.13 d + 0.6 h + 0.4 b)
Stored per case `{dtype}/{B}x{H}x{T}x{hd}/{name}`: the inputs q, k, v, dout (dtype), the
output `out` (dtype), `lse` (f32, the kernel's log-sum-exp per row, from
`aten._scaled_dot_product_flash_attention_for_cpu`) and the gradients dq, dk, dv (dtype)
of `out.backward(dout)`. torch.set_num_threads(1) (the kernel's results do not depend on
it; one thread is the reproducible choice).

Run: /work/torchenv/bin/python tests/torch_ref/make_sdpa_refs.py
writes tests/torch_ref/sdpa_refs.safetensors.
"""

import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

torch.set_num_threads(1)
CASES = [
    (1, 2, 1, 16),
    (1, 2, 8, 16),
    (2, 2, 16, 16),
    (1, 3, 37, 16),
    (2, 2, 64, 24),
    (1, 2, 70, 32),
    (1, 2, 100, 8),
    (1, 1, 40, 64),
    (1, 1, 200, 16),
]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def inputs(B, H, T, hd, dtype):
    t = torch.arange(T).view(1, 1, T, 1).float()
    d = torch.arange(hd).view(1, 1, 1, hd).float()
    h = torch.arange(H).view(1, H, 1, 1).float()
    b = torch.arange(B).view(B, 1, 1, 1).float()
    q = torch.sin(0.37 * t + 0.11 * d + 0.7 * h + 1.3 * b)
    k = torch.sin(0.23 * t + 0.19 * d + 0.5 * h + 0.9 * b + 1.0)
    v = 0.5 * torch.sin(0.31 * t + 0.07 * d + 0.3 * h + 1.1 * b + 2.0)
    dout = 0.5 * torch.cos(0.29 * t + 0.13 * d + 0.6 * h + 0.4 * b)
    return [x.to(dtype).contiguous() for x in (q, k, v, dout)]


def main():
    out = {}
    for name, dtype in DTYPES.items():
        for B, H, T, hd in CASES:
            key = f"{name}/{B}x{H}x{T}x{hd}"
            q, k, v, dout = inputs(B, H, T, hd, dtype)
            qs, ks, vs = [x.clone().requires_grad_() for x in (q, k, v)]
            y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            y.backward(dout)
            y2, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
            assert torch.equal(y.detach().view(torch.int16), y2.view(torch.int16)), key
            for n, x in [("q", q), ("k", k), ("v", v), ("dout", dout), ("out", y), ("lse", lse),
                         ("dq", qs.grad), ("dk", ks.grad), ("dv", vs.grad)]:
                out[f"{key}/{n}"] = x.detach().contiguous()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdpa_refs.safetensors")
    save_file(out, path, metadata={"torch": torch.__version__, "cases": repr(CASES)})
    print(f"wrote {path}: {len(out)} tensors")


if __name__ == "__main__":
    main()
