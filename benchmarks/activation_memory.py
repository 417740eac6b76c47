"""Activation memory per row, counted exactly: the bytes autograd saves for the backward pass.

A saved-tensors hook sums the storage of every tensor the trained pass keeps (bf16 autocast, L = 1024), for
one block of each preset's width and for the whole trunk without and with activation checkpointing; the
peak training memory per GPU is then estimated as weights + gradients + optimiser state + EMA (fp32) plus
rows x saved bytes per row. An estimate from exact counts, not a GPU measurement.

    python benchmarks/activation_memory.py
"""

from __future__ import annotations

import json

import torch

from elflow.model import ELF, get_config
from elflow.optim import ELFOptimizer


def saved_bytes(net, L, checkpoint: bool) -> int:
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    net.train()
    c = net.config
    z = torch.randn(1, L, c.dim)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        net(z, torch.rand(1), torch.full((1,), 2.0), z)
    return total


def main() -> None:
    L = 1024
    for name in ("elf-b", "elf-m", "elf-l"):
        full = get_config(name)
        out = {"preset": name, "L": L}
        for ckpt in (False, True):
            nets = [ELF(full.replace(depth=d)) for d in (1, 2)]  # one block and two, then scale by depth
            for net in nets:
                net.grad_checkpoint = ckpt
            b1, b2 = (saved_bytes(net, L, ckpt) for net in nets)
            per_block, rest = b2 - b1, 2 * b1 - b2
            out["saved_per_row_" + ("ckpt" if ckpt else "full")] = rest + full.depth * per_block
        net = ELF(full)
        params = net.num_params()
        n_adam = sum(p.numel() for n, p in net.named_parameters()
                     if n not in set(ELFOptimizer(list(net.named_parameters()), lr=1e-3).muon_names))
        state = 4 * (params * 3 + n_adam * 2)  # fp32 weights, grads, EMA (+ Muon momentum or Adam's two moments)
        state += 4 * (params - n_adam)  # Muon momentum
        out["params"] = params
        out["weights_grads_opt_ema_bytes"] = state
        for rows in (32, 64):
            for k in ("full", "ckpt"):
                out[f"est_peak_gib_b{rows}_{k}"] = (state + rows * out["saved_per_row_" + k]) / 2 ** 30
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
