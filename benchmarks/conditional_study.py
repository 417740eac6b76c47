"""Why a conditional ELF trained on a CPU outputs garbage, stage by stage (benchmarks/RESULTS.md, section 9).

The task is copying: source = a line of the built-in corpus, target = the same line (4-14 words, MiniLM
tokens, source up to 24 and L = 48, the held-out lines of `data.shuffled_line_pairs`). Each configuration
is the quickstart's settings on pairs (`elflow train --defaults quickstart --source-length 24 --length 48`)
with a few network options changed; each trained run is then measured on held-out lines:

- sampling: target-token accuracy (share of the reference's target tokens, EOS padding excluded, read back
  exactly at their position) and BLEU, for sampler variants (ODE / SDE / variance-consistent, guidance 0, 1
  and 2, grids, seeds, the table readout switched off), each beside two readings of the final state:
  `noise_rows` is the share of generated target tokens that equal the token whose readout-table row is
  nearest to that position's starting noise z0 (chance: about 1 / vocabulary), and `beta` the least-squares
  coefficient of the final state's error (z_final - x) on z0 at the target positions (0: no starting noise
  left in the output);
- oracles, without the sampler: the readout of the clean target embeddings; the readout of the denoiser's
  x-guess from the target noised to time t (t = 0.5 ... 0.95), with and without the source, beside the
  readout of the noised input itself; the inputs and the guess of the network at the known (source)
  positions as training builds them (`flow.elf_loss`, captured) against those the sampler builds
  (`sampler.integrate`), from the same noised target.

    PYTHONPATH=src python benchmarks/conditional_study.py train copy-qs copy-released copy-minilm
    PYTHONPATH=src python benchmarks/conditional_study.py measure copy-qs --variants all
    PYTHONPATH=src python benchmarks/conditional_study.py seeds 0 1

`seeds`: the seed noise of held-out figures, two runs of the same setting that differ only in their seed, on
the same batches (`paired_config`, `held_out_figures`): results/conditional/paired-seed<N>.json.

Results: benchmarks/results/conditional/<name>.json (resumable: a measured variant is not measured again).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent / "results" / "conditional"
SOURCE_LENGTH, LENGTH = 24, 48
QUICKSTART_MODEL = {"skip": "gaussian", "time_scale": 1000.0, "head_modulation": True, "table_readout": 1.0}
RELEASED_MODEL = {"skip": "none", "time_scale": 1.0, "head_modulation": False, "table_readout": 0.0}

# name -> task, steps, note, TrainConfig overrides ("short_run": option overrides on the quickstart's)
CONFIGS: dict[str, dict] = {
    "copy-qs-stream1": {"task": "copy", "note": "quickstart options, trained before the fixes (table stream 1, "
                                              "the per-row loss mean), 400 of 800 steps", "train": None},
    "copy-qs": {"task": "copy", "note": "quickstart options (Gaussian skip, time scale, head modulation, readout)"},
    "copy-noskip": {"task": "copy", "note": "... without the Gaussian skip", "short_run": {"skip": "none"}},
    "copy-ts1": {"task": "copy", "note": "... without the time scale (1)", "short_run": {"time_scale": 1.0}},
    "copy-nomod": {"task": "copy", "note": "... without the head modulation", "short_run": {"head_modulation": False}},
    "copy-released": {"task": "copy", "note": "the released options (all four off)", "short_run": RELEASED_MODEL},
    "copy-minilm": {"task": "copy", "note": "quickstart options in MiniLM's space (no readout table)",
                    "train": {"space": "minilm"}, "short_run": {"table_readout": 0.0}},
    "copy-slot": {"task": "copy", "note": "quickstart options, the target in the fixed source slot",
                  "train": {"source_slot": "fixed"}},
    "shuffle-qs": {"task": "shuffle", "note": "the conditional demonstration's task (restore shuffled lines), "
                                              "quickstart options"},
    "shuffle-slot": {"task": "shuffle", "note": "... in the fixed source slot", "train": {"source_slot": "fixed"}},
    "slot-noskip": {"task": "copy", "note": "the fixed slot without the Gaussian skip",
                    "train": {"source_slot": "fixed"}, "short_run": {"skip": "none"}},
    "slot-ts1": {"task": "copy", "note": "the fixed slot without the time scale (1)",
                 "train": {"source_slot": "fixed"}, "short_run": {"time_scale": 1.0}},
    "slot-nomod": {"task": "copy", "note": "the fixed slot without the head modulation",
                   "train": {"source_slot": "fixed"}, "short_run": {"head_modulation": False}},
    "slot-released": {"task": "copy", "note": "the fixed slot with the released options (all four off)",
                      "train": {"source_slot": "fixed"}, "short_run": RELEASED_MODEL},
    "slot-minilm": {"task": "copy", "note": "the fixed slot in MiniLM's space (no readout table)",
                    "train": {"source_slot": "fixed", "space": "minilm"}, "short_run": {"table_readout": 0.0}},
    "copy-gated": {"task": "copy", "note": "quickstart options with the gated skip", "short_run": {"skip": "gated"}},
    "copy-gated-lr1e-2": {"task": "copy", "note": "... and lr 1e-2", "short_run": {"skip": "gated"},
                          "train": {"lr": 1e-2}},
}
STEPS = 400


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


# ----------------------------------------------------------------------------------------------------------
# tasks


def task_pairs(task: str, seed: int = 0):
    """(train, held) (source, target) text pairs of a task made from the built-in corpus."""
    from elflow.data.corpus import read_documents
    from elflow.data.tasks import shuffled_line_pairs

    train, held = shuffled_line_pairs(list(read_documents("builtin")), seed=seed)
    if task == "copy":
        return [(t, t) for _, t in train], [(t, t) for _, t in held]
    if task == "shuffle":
        return train, held
    raise ValueError(f"unknown task {task!r}")


def pairs_file(task: str) -> Path:
    from elflow.util.files import atomic_write_text

    path = ROOT / "runs" / "data" / f"{task}.jsonl"  # runs/ is git-ignored
    if not path.exists():
        train, _ = task_pairs(task)
        atomic_write_text(path, "".join(json.dumps({"input": s, "output": t}) + "\n" for s, t in train))
    return path


def train_config(name: str, steps: int | None = None):
    from elflow.config import TrainConfig
    from elflow.experiments.quickstart import preset_overrides

    c = CONFIGS[name]
    train = dict(c.get("train", {}))
    over = preset_overrides(argparse.Namespace(space=train.get("space"), lr=train.get("lr")))
    options = {**QUICKSTART_MODEL, **over.pop("short_run", {}), **c.get("short_run", {})}
    task = {"source_length": SOURCE_LENGTH, "source_slot": train.pop("source_slot", "packed")}
    cfg = TrainConfig.named("quickstart", data=str(pairs_file(c["task"])), task=task, length=LENGTH, steps=steps or c.get("steps", STEPS), seed=0, sample_every=0, keep=0,
                            **{**over, **train, "short_run": options})
    return cfg.resolved()


def train(name: str, steps: int | None = None) -> Path:
    from elflow.train import train as run_training

    out = ROOT / "runs" / name
    cfg = train_config(name, steps)
    done = out / "run.json"
    if done.exists() and json.loads(done.read_text()).get("finished"):
        return out
    t0, cpu0 = time.time(), time.process_time()
    run_training(cfg, out, resume=(out / "run.json").exists(), quiet=False)
    meta = json.loads(done.read_text())
    meta["finished"] = {"wall_s": time.time() - t0, "cpu_s": time.process_time() - cpu0,
                        "loadavg": os.getloadavg(), "cpu": cpu_model()}
    done.write_text(json.dumps(meta, indent=1))
    return out


# ----------------------------------------------------------------------------------------------------------
# measurements


def reference_batch(space, held, device="cpu", slot="packed"):
    """The held-out pairs laid out and encoded exactly as training encodes them: ids (N, L), known (N, L),
    target positions (N, L) (reference target tokens, EOS padding excluded) and clean x (N, L, C)."""
    from elflow.data.layout import encoder_mask, pair_layout

    src = space.tokenize([s for s, _ in held], eos=False)
    tgt = space.tokenize([t for _, t in held], eos=False)
    lay = pair_layout(src, tgt, LENGTH, SOURCE_LENGTH, space.pad_id, slot)
    ids, known = lay["ids"], lay["source_mask"]
    target = lay["valid"] & ~known
    x = space.encode(ids.to(device), encoder_mask(known, lay["valid"])).float()
    return ids, known, target, x, lay["valid"]


def options(net):
    """The network's short-run options (all off for the paper's network)."""
    from elflow.model import ShortRunOptions

    return getattr(net, "options", ShortRunOptions())


@contextmanager
def readout_off(net, off: bool = True):
    """The network with its table readout switched off inside the block (when `off`)."""
    kept = options(net)
    if off and kept.table_readout:
        net.options = replace(kept, table_readout=0.0)
    try:
        yield net
    finally:
        if kept.table_readout:
            net.options = kept


def _token_accuracy(pred, ids, target):
    return ((pred == ids) & target).sum().item() / max(target.sum().item(), 1)


@torch.no_grad()
def sample_variant(loaded, space, held, steps=64, sampler="ode", guidance=2.0, omega=1.0, gamma=1.5, grid=None,
                   seed=0, readout=True, batch=32, final=None) -> dict:
    """Generate for the held-out sources as `generate.generate` does (same seeds and draws), keeping z0 and
    the final state, and score the target tokens."""
    from elflow.eval.metrics import bleu
    from elflow.flow import time_grid
    from elflow.generate import conditioning, extract_targets
    from elflow.sampler import generate_tokens

    net = loaded
    table = net.readout_table if options(net).table_readout else None
    recipe, slot = net.record.recipe, net.record.source_slot
    ids_ref, known_ref, target, x_ref, _ = reference_batch(space, held, slot=slot)
    keep = LENGTH - SOURCE_LENGTH
    out_ids, texts, noise_hits, noise_n, num, den, last_t = [], [], 0, 0, 0.0, 0.0, []
    with readout_off(net, not readout):
        for b, start in enumerate(range(0, len(held), batch)):
            chunk = held[start:start + batch]
            bs = len(chunk)
            known_ids, known_mask, known = conditioning(space, LENGTH, bs, [s for s, _ in chunk], SOURCE_LENGTH,
                                                        source_slot=slot)
            g = torch.Generator().manual_seed(seed * 100_003 + b)
            kw = dict(steps=steps, sampler=sampler, gamma=gamma, omega=omega, grid=grid or "logit_normal",
                      guidance=guidance, known=known, known_mask=known_mask, generator=g, recipe=recipe)
            ids, z = generate_tokens(net, bs, LENGTH, **kw)
            g0 = torch.Generator().manual_seed(seed * 100_003 + b)  # the same first draws: z0, then the grid
            z0 = recipe.noise_scale * torch.randn(bs, LENGTH, net.config.dim, generator=g0)
            last_t.append(time_grid(steps, grid or "logit_normal", generator=g0)[-2].item())
            ids = torch.where(known_mask, known_ids, ids)
            tgt = target[start:start + bs]
            out_ids.append(ids)
            gen = tgt & (ids != space.eos_id)
            if table is not None:  # the token whose table row is nearest to the starting noise
                nearest = (z0 @ table.T).argmax(-1)
                noise_hits += ((ids == nearest) & gen).sum().item()
                noise_n += gen.sum().item()
            err = (z - x_ref[start:start + bs]) * tgt[..., None]
            num += (err * z0).sum().item()
            den += (z0.pow(2) * tgt[..., None]).sum().item()
            src_len = known_mask.sum(1)
            texts += space.decode(extract_targets(ids, src_len, keep, space.eos_id))
    ids = torch.cat(out_ids)
    refs = [t for _, t in held]
    return {"token_accuracy": _token_accuracy(ids, ids_ref, target), "bleu": bleu(texts, refs),
            "noise_rows": noise_hits / noise_n if noise_n else None, "beta": num / max(den, 1e-12),
            "last_interior_t": sum(last_t) / len(last_t), "examples": [
                {"source": s, "output": o} for (s, _), o in list(zip(held, texts))[:3]]}


@torch.no_grad()
def oracles(loaded, space, held, ts=(0.3, 0.5, 0.7, 0.9, 0.95), seed=0) -> dict:
    """The readout of clean targets; the readout of the denoiser's guess from the noised target (with and
    without the source) beside the readout of the noised input; the network's inputs and guess at the known
    positions as training builds them against the sampler."""
    from elflow.flow import Draw, elf_loss, row_index
    from elflow.sampler import integrate

    net = loaded
    recipe, slot = net.record.recipe, net.record.source_slot
    ids, known, target, x, valid = reference_batch(space, held, slot=slot)
    N, L, C = x.shape
    ones = torch.ones(N)
    out = {"decode_clean": _token_accuracy(net.decode(x, ones).argmax(-1), ids, target)}
    if options(net).table_readout:
        with readout_off(net):
            out["decode_clean_head_only"] = _token_accuracy(net.decode(x, ones).argmax(-1), ids, target)
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(N, L, C, generator=g)
    pin = known[..., None]
    guesses = {}
    for t in ts:
        z = torch.where(pin, x, t * x + (1 - t) * recipe.noise_scale * eps)
        tt = torch.full((N,), t)
        cond = net(z, tt, ones, torch.where(pin, x, torch.zeros_like(x)))
        drop = net(z.masked_fill(pin, 0.0), tt, ones, torch.zeros_like(x))
        row = {"input": _token_accuracy(net.decode(z, ones).argmax(-1), ids, target),
               "guess": _token_accuracy(net.decode(torch.where(pin, x, cond), ones).argmax(-1), ids, target),
               "guess_source_dropped": _token_accuracy(net.decode(drop.masked_fill(pin, 0.0), ones).argmax(-1),
                                                       ids, target),
               "mse_guess": ((cond - x).pow(2).mean(-1) * target).sum().item() / target.sum().item(),
               "mse_baseline": None}
        if options(net).skip != "none":
            from elflow.model import gaussian_posterior

            base = gaussian_posterior(z, tt, net.skip_mean, net.skip_var, net.skip_noise)[0]
            row["mse_baseline"] = ((base - x).pow(2).mean(-1) * target).sum().item() / target.sum().item()
        guesses[f"t={t}"] = row

    # known positions: what training's elf_loss feeds the network against what sampler.integrate feeds it
    t = 0.5
    seen = {}

    def capture(z, t_, omega, slot, gate, dec):
        seen["train"] = (z.detach(), slot.detach())
        return net.mixed(z, t_, omega, slot, gate, dec)

    none = torch.zeros(N, dtype=torch.bool)
    draw = Draw(t=torch.full((N,), t), omega=ones, eps=eps, p=torch.ones(N, L, 1), decode=none, self_cond=none,
                drop_source=none, decode_rows=row_index(none, None), self_cond_rows=row_index(none, None))
    elf_loss(net, x, ids, draw, recipe, valid=torch.ones_like(known), known=known, trained=capture)
    z_train, slot_train = seen["train"]

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net
            self.config = net.config

        def forward(self, z, t_, omega, slot):
            seen.setdefault("sample", (z.detach(), slot.detach()))
            return net(z, t_, omega, slot)

    from elflow.generate import conditioning

    _, kmask, kx = conditioning(space, L, N, [s for s, _ in held], SOURCE_LENGTH, source_slot=slot)
    z_sample_in = t * x + (1 - t) * recipe.noise_scale * eps
    z_final, _ = integrate(Spy(), z_sample_in, torch.tensor([t, 1.0]), sampler="ode", omega=ones, guidance=1.0,
                        known=kx, known_mask=kmask, noise_scale=recipe.noise_scale, t_eps=recipe.t_eps)
    z_s, slot_s = seen["sample"]
    x_train = torch.where(pin, x, net(z_train, draw.t, ones, slot_train))
    out["known"] = {"same_mask": bool(torch.equal(kmask, known)),
                    "max_diff_source_vectors": (kx - x * pin).abs().max().item(),
                    "max_diff_z": (z_s - z_train).abs().max().item(),
                    "max_diff_slot": (slot_s - slot_train).abs().max().item(),
                    "max_diff_guess": (z_final - x_train).abs().max().item()}
    out["guess"] = guesses
    return out


VARIANTS = {
    "ode-g2": {}, "ode-g1": {"guidance": 1.0}, "ode-g0": {"guidance": 0.0},
    "sde-g2": {"sampler": "sde", "omega": 3.0}, "vc-g2": {"sampler": "vc", "omega": 3.0},
    "ode-g2-seed1": {"seed": 1}, "ode-g2-noreadout": {"readout": False},
    "ode-g2-uniform": {"grid": "uniform"},
}


def measure(name: str, variants, num: int) -> dict:
    from elflow.runs.load import load_for_sampling

    path = ROOT / f"{name}.json"
    res = json.loads(path.read_text()) if path.exists() else {"name": name, "variants": {}}
    run = ROOT / "runs" / name
    loaded, space = load_for_sampling(run, device="cpu")
    held = task_pairs(CONFIGS[name]["task"])[1][:num]
    res["note"] = CONFIGS[name]["note"]
    res["train"] = json.loads((run / "run.json").read_text()).get("finished")
    if "oracles" not in res:
        res["oracles"] = oracles(loaded, space, held)
    for v in variants:
        if v in res["variants"]:
            continue
        if v.endswith("noreadout") and not options(loaded).table_readout:
            continue
        t0, cpu0 = time.time(), time.process_time()
        r = sample_variant(loaded, space, held, **VARIANTS[v])
        r.update(settings=VARIANTS[v], wall_s=time.time() - t0, cpu_s=time.process_time() - cpu0,
                 loadavg=os.getloadavg())
        res["variants"][v] = r
        print(f"{name} {v}: acc {r['token_accuracy']:.1%} bleu {r['bleu']:.2f} noise_rows {r['noise_rows']} "
              f"beta {r['beta']:.3f}", flush=True)
        path.write_text(json.dumps(res, indent=1))
    res["cpu"] = cpu_model()
    path.write_text(json.dumps(res, indent=1))
    return res


# ----------------------------------------------------------------------------------------------------------
# seed noise: two elflow runs that differ only in their seed, on the same batches


PAIRED_TIMES = (0.05, 0.15, 0.3, 0.5, 0.7)
PAIRED_STEPS = 200


def paired_config(seed: int):
    """The paired setting: the demo network without the short-run options (the paper's network) in MiniLM's
    space, on shuffled lines (source = the words shuffled, target = the line), L 48, source 24, batch 32,
    source drop 0.1, decode corruption 1.0, the quickstart's optimiser settings, 200 steps."""
    from elflow.config import TrainConfig

    cfg = TrainConfig.named("quickstart", data=str(pairs_file("shuffle")), space="minilm", short_run=RELEASED_MODEL,
                            task={"source_length": SOURCE_LENGTH}, length=LENGTH, steps=PAIRED_STEPS, seed=seed,
                            sample_every=0, keep=1)
    return cfg.resolved()


@contextmanager
def data_of_seed(data_seed: int):
    """Inside the block, a run's data split and batch order are those of `data_seed`, whatever its own seed
    (which keeps the network's initialisation and the training noise)."""
    import elflow.data
    import elflow.train

    split, batches = elflow.train.training_data, elflow.data.Batches
    elflow.train.training_data = lambda cfg, *a, **k: split(replace(cfg, seed=data_seed), *a, **k)
    elflow.data.Batches = lambda *a, seed=0, **k: batches(*a, seed=data_seed, **k)
    try:
        yield
    finally:
        elflow.train.training_data, elflow.data.Batches = split, batches


@torch.no_grad()
def held_out_figures(net, space, val, recipe, rows: int = 256, seed: int = 0) -> dict:
    """Held-out v-space MSE on the target positions at fixed times, with the source and with it dropped (the
    same draws for every network; the clean source in the self-conditioning slot, as in training), and the
    readout's accuracy on the targets corrupted as decode rows are."""
    from elflow.data.layout import encoder_mask
    from elflow.flow import decode_levels

    b = val.batch(torch.arange(min(rows, len(val))))
    tokens, known, valid = b["tokens"], b["known"], b["attention_mask"]
    N, L = tokens.shape
    target = ~known & b["mask"]
    ones = torch.ones(N)
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(N, L, space.dim, generator=g)
    p = decode_levels((N, L, 1), recipe, g)
    noise = torch.randn(N, L, space.dim, generator=g)
    out = {"rows": N}
    for name, drop in (("with_source", False), ("source_dropped", True)):
        x = space.encode(tokens, encoder_mask(known, valid, torch.full((N,), drop))).float()
        pin = known[..., None]
        source = torch.zeros_like(x) if drop else x
        x = torch.where(pin, source, x)
        slot = torch.where(pin, source, torch.zeros_like(x))
        for t in PAIRED_TIMES:
            z = torch.where(pin, source, t * x + (1 - t) * recipe.noise_scale * eps)
            err = ((net(z, torch.full((N,), t), ones, slot).float() - x) / max(1 - t, recipe.t_eps)).pow(2).mean(-1)
            out[f"{name} t={t}"] = ((err * target).sum() / target.sum()).item()
        if not drop:
            pred = net.decode(p * x + (1 - p) * recipe.decode_noise_scale * noise, ones).argmax(-1)
            out["decode_accuracy"] = ((pred == tokens) & target).sum().item() / target.sum().item()
    return out


def seeds(seed_list) -> dict:
    """Train the paired setting with each seed on the batches of seed 0, and measure each run's EMA weights
    on the same held-out rows."""
    from elflow.data.datasets import build_pairs
    from elflow.runs.load import load_for_sampling

    res = {}
    for seed in seed_list:
        key = f"seed{seed}"
        path = ROOT / f"paired-{key}.json"
        if path.exists():
            res[key] = json.loads(path.read_text())
            continue
        cfg = paired_config(seed)
        out = ROOT / "runs" / f"paired-{key}"
        t0, cpu0 = time.time(), time.process_time()
        with data_of_seed(0):
            from elflow.train import train as run_training

            run_training(cfg, out, resume=(out / "run.json").exists(), quiet=False)
        wall, cpu = time.time() - t0, time.process_time() - cpu0
        loaded, space = load_for_sampling(out, device="cpu")
        _, val = build_pairs(cfg.data, space, SOURCE_LENGTH, LENGTH, val_fraction=cfg.val_fraction, seed=0)
        fig = held_out_figures(loaded, space, val, loaded.record.recipe)
        res[key] = {**fig, "train_wall_s": wall, "train_cpu_s": cpu, "loadavg": os.getloadavg(), "cpu": cpu_model(),
                    "torch_threads": torch.get_num_threads(), "dtype": cfg.dtype}
        path.write_text(json.dumps(res[key], indent=1))
        print(key, json.dumps(fig), flush=True)
    return res



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["train", "measure", "seeds"])
    p.add_argument("names", nargs="*")
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default {STEPS})")
    p.add_argument("--variants", nargs="*", default=["ode-g2"], help="sampling variants (or 'all')")
    p.add_argument("--num", type=int, default=128, help="held-out lines")
    args = p.parse_args(argv)
    ROOT.mkdir(parents=True, exist_ok=True)
    if args.command == "train":
        for n in args.names:
            train(n, args.steps)
    elif args.command == "measure":
        variants = list(VARIANTS) if args.variants == ["all"] else args.variants
        for n in args.names:
            measure(n, variants, args.num)
    else:
        seeds([int(n) for n in args.names] or [0, 1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
