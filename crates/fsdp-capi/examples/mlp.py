#!/usr/bin/env python3
"""A Python host (ctypes and numpy, no PyTorch) that computes an MLP with numpy and trains
it with FSDP through fsdp's C ABI (libfsdp_capi.so, crates/fsdp-capi/include/fsdp.h). One
process per rank, started by `fsdp launch` (or torchrun): the tcp backend meets through the
torchrun environment.

    fsdp launch --nproc-per-node 2 -- python3 crates/fsdp-capi/examples/mlp.py \
        --lib target/release/libfsdp_capi.so

The model, data and optimizer are mlp.c's (beside this file): Linear "0" (5x7) - ReLU -
Linear "2" (3x5), a global batch of 8 rows split across the ranks, SGD (lr 0.1, momentum
0.9), 5 steps. Rank 0 prints "loss STEP VALUE" and "param NAME v0 v1 ..." lines.
"""
import argparse
import ctypes as C
import os
import sys

import numpy as np


class DLDevice(C.Structure):
    _fields_ = [("device_type", C.c_int32), ("device_id", C.c_int32)]


class DLDataType(C.Structure):
    _fields_ = [("code", C.c_uint8), ("bits", C.c_uint8), ("lanes", C.c_uint16)]


class DLTensor(C.Structure):
    _fields_ = [
        ("data", C.c_void_p),
        ("device", DLDevice),
        ("ndim", C.c_int32),
        ("dtype", DLDataType),
        ("shape", C.POINTER(C.c_int64)),
        ("strides", C.POINTER(C.c_int64)),
        ("byte_offset", C.c_uint64),
    ]


class Handle(C.Structure):  # fsdp_group_t, fsdp_spec_t, fsdp_model_t, ...
    _fields_ = [("id", C.c_uint64)]


class Config(C.Structure):  # fsdp_config
    _fields_ = [
        ("sharding_strategy", C.c_int32),
        ("ranks_per_node", C.c_int32),
        ("mixed_precision", C.c_int32),
        ("cpu_offload", C.c_bool),
        ("backward_prefetch", C.c_int32),
        ("forward_prefetch", C.c_bool),
        ("limit_all_gathers", C.c_bool),
        ("sync_module_states", C.c_bool),
        ("device", DLDevice),  # {kDLCPU, 0}; {kDLCUDA, i} computes on that GPU
    ]


class OptimizerConfig(C.Structure):  # fsdp_optimizer_config
    _fields_ = [("kind", C.c_int32)] + [
        (n, C.c_float)
        for n in ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening")
    ] + [("nesterov", C.c_bool)]


# From include/fsdp.h.
FSDP_ABI_VERSION = 2
kDLCPU, kDLFloat = 1, 2
FSDP_INIT_UNIFORM, FSDP_OPTIM_SGD, FSDP_REDUCE_SUM = 1, 0, 0
STRATEGIES = {"full-shard": 0, "shard-grad-op": 1, "no-shard": 2}
CALLBACK = C.CFUNCTYPE(C.c_int32, C.c_void_p, C.c_char_p, C.POINTER(DLTensor))


class Fsdp:
    """libfsdp_capi with every call checked: a status other than FSDP_OK raises."""

    def __init__(self, path):
        self.lib = C.CDLL(path)
        self.lib.fsdp_last_error.restype = C.c_char_p
        self.lib.fsdp_status_name.restype = C.c_char_p
        self.lib.fsdp_abi_version.restype = C.c_uint32
        # The structs above are this ABI version's: another library would misread them.
        got = self.lib.fsdp_abi_version()
        if got != FSDP_ABI_VERSION:
            raise RuntimeError(f"{path} has C ABI {got}, this host is written for {FSDP_ABI_VERSION}")

    def __getattr__(self, name):
        f = getattr(self.lib, "fsdp_" + name)

        def call(*args):
            s = f(*args)
            if s != 0:
                raise RuntimeError(
                    f"{self.lib.fsdp_status_name(s).decode()}: {self.lib.fsdp_last_error().decode()}"
                )

        return call


def view(t):
    """A numpy array over fsdp's memory (no copy), float32 of the tensor's shape."""
    assert t.device.device_type == kDLCPU and t.dtype.code == kDLFloat and t.dtype.bits == 32
    shape = tuple(t.shape[i] for i in range(t.ndim))
    return np.ctypeslib.as_array(C.cast(t.data, C.POINTER(C.c_float)), shape=shape)


def dltensor(a, keep):
    """A DLTensor describing the float32 array `a` (kept alive through `keep`)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    shape = (C.c_int64 * a.ndim)(*a.shape)
    keep += [a, shape]
    return DLTensor(a.ctypes.data, DLDevice(kDLCPU, 0), a.ndim, DLDataType(kDLFloat, 32, 1), shape, None, 0)


def data_value(seed, i):
    """mlp.c's data_value: the same uint32 hash and float32 operations."""
    m = 0xFFFFFFFF
    h = ((seed * 2654435761) & m) ^ (((i + 1) * 2246822519) & m)
    h ^= h >> 15
    h = (h * 2246822519) & m
    h ^= h >> 13
    h = (h * 3266489917) & m
    h ^= h >> 16
    return np.float32(h % 2001) / np.float32(1000.0) - np.float32(1.0)


def batch(step, lo, hi):
    x = np.array([data_value(100 + step, i) for i in range(lo * 7, hi * 7)], np.float32)
    t = np.array([data_value(200 + step, i) for i in range(lo * 3, hi * 3)], np.float32)
    return x.reshape(hi - lo, 7), t.reshape(hi - lo, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--lib", default=os.environ.get("FSDP_LIB", "target/release/libfsdp_capi.so")
    )
    ap.add_argument("--strategy", default="full-shard", choices=STRATEGIES)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    f = Fsdp(args.lib)

    world = Handle()
    f.init_process_group(None, C.byref(world))  # tcp, from the torchrun environment
    rank, size = C.c_int32(), C.c_int32()
    f.group_rank(world, C.byref(rank))
    f.group_size(world, C.byref(size))
    rank, size = rank.value, size.value

    spec = Handle()
    f.spec_new(C.byref(spec))
    for unit, (o, i) in (("0", (5, 7)), ("2", (3, 5))):
        bound = C.c_float(1.0 / np.sqrt(np.float32(i)))
        f.spec_add_unit(spec, unit.encode())
        for name, shape in (("weight", (o, i)), ("bias", (o,))):
            dims = (C.c_int64 * len(shape))(*shape)
            f.spec_add_param_init(spec, unit.encode(), name.encode(), len(shape), dims,
                                  FSDP_INIT_UNIFORM, C.c_uint64(11), bound, True)
    cfg = Config()
    f.config_default(C.byref(cfg))
    cfg.sharding_strategy = STRATEGIES[args.strategy]
    model = Handle()
    f.model_new(world, spec, C.byref(cfg), C.byref(model))
    f.spec_free(spec)
    root, u0, u2 = Handle(), Handle(), Handle()
    f.model_unit_at(model, C.c_size_t(0), C.byref(root))
    f.model_unit(model, b"0", C.byref(u0))
    f.model_unit(model, b"2", C.byref(u2))
    oc = OptimizerConfig()
    f.optimizer_config_default(FSDP_OPTIM_SGD, C.byref(oc))
    oc.lr, oc.momentum = 0.1, 0.9
    opt = Handle()
    f.optimizer_new(model, C.byref(oc), C.byref(opt))

    lo, hi = rank * 8 // size, (rank + 1) * 8 // size
    p, g = (DLTensor * 2)(), (DLTensor * 2)()
    for step in range(args.steps):
        x, t = batch(step, lo, hi)
        n = hi - lo
        # forward: the root encloses the units
        f.unit_pre_forward(root, True, None, C.c_size_t(0), None)
        f.unit_pre_forward(u0, True, p, C.c_size_t(2), None)
        h = x @ view(p[0]).T + view(p[1])
        f.unit_post_forward(u0, True, None)
        a = np.maximum(h, 0)
        f.unit_pre_forward(u2, True, p, C.c_size_t(2), None)
        y = a @ view(p[0]).T + view(p[1])
        f.unit_post_forward(u2, True, None)
        f.unit_post_forward(root, True, None)
        d = y - t
        dy = (np.float32(2) * d / np.float32(n * 3)).astype(np.float32)
        # backward, in reverse: unit "2" adds into fsdp's gradient views ...
        f.unit_pre_backward(root, None, None, C.c_size_t(0), None)
        f.unit_pre_backward(u2, p, g, C.c_size_t(2), None)
        view(g[0])[...] += dy.T @ a
        view(g[1])[...] += dy.sum(axis=0)
        da = dy @ view(p[0])
        f.unit_post_backward(u2, None, C.c_size_t(0), True, None)
        dh = np.where(h > 0, da, np.float32(0))
        # ... unit "0" hands its own arrays to post_backward
        f.unit_pre_backward(u0, None, None, C.c_size_t(2), None)
        keep = []
        mine = (DLTensor * 2)(dltensor(dh.T @ x, keep), dltensor(dh.sum(axis=0), keep))
        f.unit_post_backward(u0, mine, C.c_size_t(2), True, None)
        f.unit_post_backward(root, None, C.c_size_t(0), True, None)
        f.model_finish_backward(model, None)
        f.optimizer_step(opt, None)
        f.model_zero_grad(model)
        sse = np.array([np.sum(d * d, dtype=np.float32)], np.float32)
        f.all_reduce(world, C.byref(dltensor(sse, keep)), FSDP_REDUCE_SUM, None)
        if rank == 0:
            print(f"loss {step} {sse[0] / np.float32(24):.9g}")

    lines = []

    def collect(ctx, name, tensor):
        lines.append(f"param {name.decode()} " + " ".join(f"{v:.9g}" for v in view(tensor[0]).ravel()))
        return 0

    f.model_full_state_dict(model, True, CALLBACK(collect), None, None)
    if rank == 0:
        print("\n".join(lines))
    f.optimizer_free(opt)
    f.model_free(model)
    f.destroy_process_group(world)


if __name__ == "__main__":
    sys.exit(main())
