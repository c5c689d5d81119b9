"""The four examples of PyTorch's FullyShardedDataParallel docs as `examples/*.rs` runs them,
in PyTorch on the CPU (gloo), printing what the Rust examples print with `--torch-init`.

    torchrun --standalone --nproc-per-node W tests/torch_ref/fsdp_examples.py NAME
    (W = 1 or 2; NAME = simple_model | shard_grad_op | big_model | transformer_blocks
     | transformer_blocks_ckpt)

`transformer_blocks_ckpt` trains the fourth example's model for 3 SGD steps (mse loss)
with `apply_activation_checkpointing(checkpoint_wrapper, NO_REENTRANT)` on every
TransformerBlock after FSDP wrapping (FSDP1 + `checkpoint_wrapper`, as torchtitan and
the FSDP tutorials do); it checks that the losses and parameters equal the same run
without checkpointing, bit for bit, and prints the losses (tests/fsdp/activation_checkpointing.rs).

Every rank seeds `torch.manual_seed(0)` and builds the same model and input; rank 0 prints
in the format of the Rust examples (f32 results printed as the f64 they convert to). The
printouts of PyTorch 2.11.0 (pip, CPU) at world sizes 1 and 2 are in fsdp_examples.txt;
tests/train/torch_examples.rs checks the Rust models against them.
"""
import functools, os, sys
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


name = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
cpu = torch.device("cpu")

def out(*a):
    if rank == 0:
        print(*a, flush=True)

def head(y):
    return y.flatten()[:4].tolist()

class TransformerBlock(nn.Module):
    """The block of the fourth docs example (transformer_blocks, transformer_blocks_ckpt)."""
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    def forward(self, x):
        return self.net(x)

if name == "simple_model":
    model = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 128))
    model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=cpu)
    x = torch.randn(8, 1024)
    y = model(x)
    out(list(y.shape), "sum", y.sum().item(), "first", head(y))
elif name == "shard_grad_op":
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64))
    model = FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, device_id=cpu)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 256)
    y = model(x)
    loss = y.sum()
    loss.backward()
    opt.step()
    out("loss", loss.item(), "output", list(y.shape))
elif name == "big_model":
    model = nn.Linear(2048, 2048)
    # CPUOffload(offload_params=True) needs CUDA in PyTorch; the printed values do not
    # depend on where the shards live, so the CPU reference keeps them in place.
    model = FSDP(model, device_id=cpu)
    x = torch.randn(2, 2048)
    y = model(x)
    y.sum().backward()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    out(list(y.shape), "sum", y.sum().item(), "first", head(y))
elif name == "transformer_blocks":
    model = nn.Sequential(*[TransformerBlock() for _ in range(4)], nn.Linear(512, 10))
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={TransformerBlock})
    model = FSDP(model, auto_wrap_policy=policy, device_id=cpu)
    units = sum(1 for m in model.modules() if isinstance(m, FSDP))
    x = torch.randn(4, 512)
    y = model(x)
    out(list(y.shape), f"({units} FSDP units: 4 blocks + root)", "sum", y.sum().item(),
        "first", head(y))
elif name == "transformer_blocks_ckpt":
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)


    def train(ckpt):
        torch.manual_seed(0)
        model = nn.Sequential(*[TransformerBlock() for _ in range(4)], nn.Linear(512, 10))
        policy = functools.partial(transformer_auto_wrap_policy,
                                   transformer_layer_cls={TransformerBlock})
        model = FSDP(model, auto_wrap_policy=policy, device_id=cpu)
        if ckpt:
            apply_activation_checkpointing(
                model,
                checkpoint_wrapper_fn=functools.partial(
                    checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
                check_fn=lambda m: isinstance(m, TransformerBlock))
            wrapped = sum(1 for m in model.modules() if type(m).__name__ == "CheckpointWrapper")
            assert wrapped == 4, wrapped
        x, t = torch.randn(4, 512), torch.randn(4, 10)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = nn.functional.mse_loss(model(x), t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with FSDP.summon_full_params(model):
            params = [p.detach().clone() for p in model.parameters()]
        return losses, params

    losses, params = train(True)
    plain_losses, plain_params = train(False)
    assert losses == plain_losses, (losses, plain_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    out("losses", losses, "(equal without checkpoint_wrapper, parameters too)")
else:
    raise SystemExit(f"unknown example {name}")
dist.destroy_process_group()
