"""elflow's training beside the released training step, on identical batches: the held-out result after N steps
(benchmarks/RESULTS.md, section 12).

Two copies of one initial network train on the same batches of the same run (elflow's own data pipeline,
`train.set_up`) with the same draws (`train.shard_generators` per step):

    elflow     train.train_step: the method's loss, clipping at 1.0, elflow.optim.ELFOptimizer (the run's
               update rule, the default "released" unless --update-rule says otherwise)
    released   tests/authors_cond_step.py: the released loss re-written from the published semantics, its
               clipping, and the released optimiser re-written from its formulas (`ReleasedOptimizer`)

Both in fp32, the same learning rate (linear warm-up, then constant). After training, both raw weights are
scored on the same held-out rows with the same noise: the v-space MSE at t = 0.05 / 0.15 / 0.3 / 0.5 / 0.7
(conditional runs: with the source present and dropped) and the decode accuracy of the target tokens from
p x + (1 - p) s n, p drawn per token as in training. Reported: each side's numbers and elflow's relative
difference in percent.

    PYTHONPATH=src python benchmarks/train_parity.py --task cond --seed 0 --out benchmarks/results/train_parity
    PYTHONPATH=src python benchmarks/train_parity.py --task text --seed 0 --out benchmarks/results/train_parity
    PYTHONPATH=src python benchmarks/train_parity.py --task cond --steps 4 --rows 32   # a check, a minute
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from authors_cond_step import (  # noqa: E402
    ReleasedOptimizer,
    authors_cond_loss,
    clip_by_global_norm,
    released_encoder_mask,
)

from elflow.config import TrainConfig  # noqa: E402
from elflow.data.batches import Prefetch  # noqa: E402
from elflow.data.corpus import task_pairs_file  # noqa: E402
from elflow.data.datasets import run_data  # noqa: E402
from elflow.flow import draw_decode_level  # noqa: E402
from elflow.methods import get_method  # noqa: E402
from elflow.methods.base import TrainedPass  # noqa: E402
from elflow.train import set_up, shard_generators, train_step  # noqa: E402
from elflow.util.devices import flushed_denormals  # noqa: E402

TIMES = (0.05, 0.15, 0.3, 0.5, 0.7)


def config(task: str, steps: int, seed: int, update_rule: str, cache_dir) -> TrainConfig:
    """The demo network in MiniLM's space, batch 32, lr 1e-3, fp32; pairs of shuffled lines (L 48, source 24)
    or text (L 64)."""
    common = dict(preset="demo", space="minilm", batch=32, lr=1e-3, warmup=20, steps=steps, seed=seed,
                  dtype="fp32", update_rule=update_rule, sample_every=0)
    if task == "cond":
        pairs = task_pairs_file("shuffle", cache_dir=cache_dir)[2]
        return TrainConfig(data=str(pairs), length=48, task={"source_length": 24}, **common).resolved()
    return TrainConfig(data="builtin", length=64, **common).resolved()


def released_step(net, params, opt, space, recipe, batch, seed, step, lr):
    """One step of the released recipe on one shard: its loss, clipping at 1.0, its optimiser."""
    g, c = shard_generators(seed, step, 0, "cpu")
    d = get_method("elf").draw(batch, space, recipe, g, c)
    tokens, known = batch["tokens"], batch.get("known")
    if known is not None:
        mask = released_encoder_mask(known, batch["attention_mask"], d.drop_source)
    else:
        known, mask = torch.zeros_like(tokens, dtype=torch.bool), batch.get("attention_mask")
    with torch.no_grad():
        x = space.encode(tokens, mask).float()
    net.zero_grad(set_to_none=True)
    loss = authors_cond_loss(net, x, tokens, known, d, recipe, valid=batch.get("mask"))
    loss.backward()
    clipped = clip_by_global_norm({n: p.grad for n, p in params.items() if p.grad is not None}, 1.0)
    for n, p in params.items():
        if p.grad is not None:
            p.grad = clipped[n]
    opt.step(params, lr)
    return loss.item()


@torch.no_grad()
def held_out(net, space, recipe, rows: list[dict], seed: int = 1234) -> dict:
    """v-MSE per time (source present, and dropped for pairs) and decode accuracy on held-out rows."""
    out = {}
    gen = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}

    def add(key, value, n):
        sums[key] = sums.get(key, 0.0) + value
        counts[key] = counts.get(key, 0.0) + n

    for batch in rows:
        tokens = batch["tokens"]
        B, L = tokens.shape
        valid = batch.get("mask")
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool()
        known = batch.get("known")
        pairs = known is not None
        known = known if pairs else torch.zeros_like(valid)
        scored = (valid & ~known).float()
        eps = torch.randn(B, L, space.dim, generator=gen)
        noise = torch.randn(B, L, space.dim, generator=gen)
        p = draw_decode_level((B, L, 1), gen)
        for dropped in ((False, True) if pairs else (False,)):
            drop = torch.full((B,), dropped)
            mask = released_encoder_mask(known, batch["attention_mask"], drop) if pairs else batch.get("attention_mask")
            x = space.encode(tokens, mask).float()
            src = known[..., None]
            x = torch.where(src & dropped, torch.zeros_like(x), x)
            slot = torch.where(src, x, torch.zeros_like(x))
            omega = torch.ones(B)
            for t in TIMES:
                z = torch.where(src, x, t * x + (1 - t) * recipe.noise_scale * eps)
                x_pred = net(z, torch.full((B,), t), omega, slot)
                err = ((x_pred - x) / max(1 - t, recipe.t_eps)).pow(2).mean(-1)  # (v_pred - v)^2
                add(f"vmse_t{t}{'_dropped' if dropped else ''}", float((err * scored).sum()), float(scored.sum()))
            if not dropped:
                z = p * x + (1 - p) * recipe.decode_noise_scale * noise
                hit = (net.decode(z, omega).argmax(-1) == tokens).float()
                add("decode_acc", float((hit * scored).sum()), float(scored.sum()))
    for k in sums:
        out[k] = sums[k] / max(counts[k], 1)
    return out


def compare(task: str, steps: int, seed: int, n_rows: int, update_rule: str, cache_dir) -> dict:
    cfg = config(task, steps, seed, update_rule, cache_dir)
    setup = set_up(cfg, get_method("elf"), 0, 1, torch.device("cpu"), cache_dir)
    net_a = setup.net
    net_b = copy.deepcopy(net_a)
    params_b = dict(net_b.named_parameters())
    opt_b = ReleasedOptimizer()
    held = run_data(cfg, setup.space, setup.length, cache_dir)[1]
    model = TrainedPass(setup.method, net_a, setup.space, setup.recipe)
    batches = Prefetch(setup.batches, steps, setup.micro, setup.accum, pin=False)
    log = []
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            lr = setup.lr_at(step)
            setup.optimizer.set_lr(lr)
            shards, _ = next(batches)
            (batch,) = shards
            m = train_step(model, shards, setup.optimizer, None, step, cfg.seed, 0, "fp32", cfg.grad_clip)
            loss_b = released_step(net_b, params_b, opt_b, setup.space, setup.recipe, batch, cfg.seed, step, lr)
            log.append({"step": step + 1, "loss_elflow": m["loss"].item(), "loss_released": loss_b})
            if (step + 1) % 20 == 0 or step + 1 == steps:
                print(f"  step {step + 1}: loss elflow {log[-1]['loss_elflow']:.4f} released {loss_b:.4f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        batches.close()
    rows = held_rows(held, n_rows, cfg.batch)
    a = held_out(net_a.eval(), setup.space, setup.recipe, rows)
    b = held_out(net_b.eval(), setup.space, setup.recipe, rows)
    diff = {k: 100 * (a[k] - b[k]) / b[k] for k in b if k.startswith("vmse")}
    diff["decode_acc_points"] = 100 * (a["decode_acc"] - b["decode_acc"])
    return {"task": task, "steps": steps, "seed": seed, "update_rule": cfg.update_rule, "held_out_rows": n_rows,
            "elflow": a, "released": b, "elflow_minus_released_percent": diff, "log": log,
            "seconds": time.perf_counter() - t0, "cpu": platform.processor() or platform.machine(),
            "settings": cfg.to_dict()}


def held_rows(held, n: int, batch: int) -> list[dict]:
    """The first `n` held-out rows as batches of the training loop's form."""
    n = min(n, len(held))
    out = []
    for i in range(0, n, batch):
        idx = list(range(i, min(i + batch, n)))
        out.append(held.batch(idx) if hasattr(held, "batch") else held[idx])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("cond", "text"), default="cond")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=int, default=256, help="held-out rows scored")
    p.add_argument("--update-rule", default="released", help="elflow's side (elflow.optim.UPDATE_RULES)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", type=Path, default=None, help="a folder for <task>-seed<seed>[-<rule>].json")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    with flushed_denormals():
        res = compare(args.task, args.steps, args.seed, args.rows, args.update_rule, args.cache_dir)
    print(f"{res['task']}, seed {res['seed']}, {res['steps']} steps, update rule {res['update_rule']}: "
          f"{res['seconds']:.0f} s")
    for k in res["released"]:
        d = res["elflow_minus_released_percent"].get(k if k != "decode_acc" else "decode_acc_points")
        unit = "points" if k == "decode_acc" else "%"
        print(f"  {k:<22} elflow {res['elflow'][k]:.4f}  released {res['released'][k]:.4f}  diff {d:+.2f} {unit}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        rule = "" if args.update_rule == "released" else f"-{args.update_rule}"
        (args.out / f"{args.task}-seed{args.seed}{rule}.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
