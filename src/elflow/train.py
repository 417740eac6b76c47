"""`elflow train`: one entry point, alone or under torchrun (DDP: NCCL on GPUs, Gloo on CPUs).

`--method` chooses what is trained: ELF (the default), or a token-level baseline, an autoregressive LM (ar)
or a masked diffusion LM (mdlm, elflow.methods). All share the data pipeline, the optimiser, the EMA, the
checkpoints, exact resume and torchrun; a baseline reads the embedding space's token ids through its
tokenizer alone (no encoder is loaded) and is sized to the parameter count of the ELF network that the same
flags would build (`--match`).

A global batch of `--batch` rows is cut into shards of `--micro-batch` rows: rank r runs shards
r*A .. r*A + A - 1 (A = accumulation steps). Each shard draws its noise from a generator seeded by
(seed, step, shard), so a run's numbers depend on the global batch only, not on how it is spread over
ranks and accumulation steps, and a resumed run needs no generator state to continue exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from elflow.data import PAIR_TASKS, encoder_mask
from elflow.encoders import DRAWN_TABLE_KINDS, TABLE_STREAM
from elflow.flow import SAMPLERS, TIME_BINS, Recipe, draw_training_noise, elf_loss, time_bin, time_bin_labels
from elflow.methods import MATCHES, METHOD_NAMES, fit_shape, get_method, table_names
from elflow.model import ELF, PRESETS, SKIPS, MixedPass, get_config, num_params
from elflow.optim import EMA, LR_DECAYS, NS_METHODS, ELFOptimizer, base_lr, lr_at
from elflow.utils import (ELFError, FolderLock, atomic_write, atomic_write_json, autocast, check_device,
                          check_output, no_space_error, resolve_dtype)

__all__ = ["TrainConfig", "RUN_PRESETS", "Objective", "train", "train_step", "shard_generators", "load_init_weights",
           "add_arguments", "run", "config_from_args"]


# ----------------------------------------------------------------------------------------------------------
# the run's settings: one dataclass, from which the CLI flags, their help and their checks are generated


def _positive(v) -> bool:
    return math.isfinite(v) and v > 0


def _at_least(lo):
    return lambda v: math.isfinite(v) and v >= lo


POSITIVE = (_positive, "> 0")
AT_LEAST_0 = (_at_least(0), ">= 0")
AT_LEAST_1 = (_at_least(1), ">= 1")
UNIT = (lambda v: 0 <= v < 1, "in [0, 1)")


def setting(default=None, help: str = "", *, default_help: str | None = None, choices=None, check=None,
            flag: str | None = None, mutable: bool = False, cli: bool = True, default_factory=None):
    """A TrainConfig field with what the CLI needs: help, choices, a value check (predicate, description),
    its flag name if not --<name>, and whether `--resume` may change it (`mutable`)."""
    meta = {"help": help, "default_help": default_help, "choices": choices, "check": check, "flag": flag,
            "mutable": mutable, "cli": cli}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


# the embedding space of each preset when --space is not given; tiny is a 32-dim random table over the MiniLM
# tokenizer (no encoder to run), so that it is cheap end to end
DEFAULT_SPACE = {"tiny": "random-table:minilm", "demo": "minilm"}
DEFAULT_SPACE_DIM = {"tiny": 32}
SMALL_EMA = 0.995  # the EMA decay of the small presets (tiny, demo); the others use the paper's 0.9999


@dataclass
class TrainConfig:
    """Everything a run needs besides the network shape; stored in run.json and in every checkpoint.

    `None` means "the preset's default" and is filled in by `resolved()`."""

    method: str = setting("elf", "what to train: ELF, or a token-level baseline over the same space's tokens: an "
                                 "autoregressive LM (ar) or a masked diffusion LM (mdlm)", choices=METHOD_NAMES)
    preset: str = setting("demo", "network size (a baseline: the parameter count of this ELF network)",
                          choices=tuple(PRESETS))
    match: str = setting("total", "baselines: match the ELF network's parameter count in all, or without the "
                                  "token tables and ELF's decode head (trunk)", choices=MATCHES)
    data: str = setting("builtin", "'builtin' (Shakespeare), a .txt file or folder, a .jsonl file, or a hub "
                                   "dataset name")
    text_field: str = setting("text", "the text field of .jsonl / hub records", flag="--field")
    on_bad: str = setting("stop", "empty, binary or non-UTF-8 files and bad jsonl lines: stop with an error, or "
                                  "skip them with a warning", choices=("stop", "skip"))
    space: str | None = setting(None, "embedding space: minilm (offline), t5-small, t5:PATH, hf:PATH, or a table "
                                      "over a base encoder's vocabulary: token-table[:BASE], random-table[:BASE], "
                                      "learned-table[:BASE]",
                                default_help="random-table:minilm (32-dim) for tiny, minilm for demo, t5-small "
                                             "otherwise")
    space_dim: int | None = setting(None, "vector size of a random-table / learned-table space",
                                    default_help="32 for tiny's default space, else the base encoder's",
                                    check=AT_LEAST_1)
    space_seed: int = setting(0, "seed of a random-table / learned-table space's vectors")
    space_stream: int | None = setting(None, "the draw of a random-table / learned-table space's vectors "
                                             "(encoders.table_generator)", cli=False)
    latent_std: str | None = setting(None, "divide encoder outputs by this: a number, 'auto' (estimated on a "
                                           "sample) or 'table' (a table's own std)", default_help="the space's")
    length: int | None = setting(None, "sequence length L", default_help="the preset's", check=AT_LEAST_1)
    layout: str = setting("packed", "packed: documents run on across rows; document: one document per row",
                          choices=("packed", "document"))
    batch: int = setting(32, "global batch: rows per optimiser step over all ranks", check=AT_LEAST_1)
    micro_batch: int | None = setting(None, "rows per forward/backward; batch / (ranks x micro-batch) "
                                            "accumulation steps", default_help="batch / ranks", check=AT_LEAST_1)
    steps: int = setting(1000, "optimiser steps (the schedule's length)", check=AT_LEAST_1, mutable=True)
    lr: float | None = setting(None, "learning rate", default_help="1e-3 x batch / 256", check=POSITIVE)
    warmup: int = setting(100, "linear warm-up steps", check=AT_LEAST_0)
    lr_decay: str = setting("constant", "after the warm-up: constant (the paper's) or a cosine decay to 0 at the "
                                        "run's last step (short runs)", choices=LR_DECAYS)
    ema_decay: float | None = setting(None, "EMA decay of the weights used for sampling",
                                      default_help=f"{SMALL_EMA} for tiny and demo, 0.9999 otherwise", check=UNIT)
    adam_heads: bool = setting(False, "optimise output heads and embedders with Adam instead of Muon "
                                      "(cheaper on CPU)")
    ns_method: str = setting("auto", "how Muon's Newton-Schulz polynomial is evaluated: iterate (torch's five "
                                     "steps), spectral (on the Gram matrix's eigenvalues, 2-4x faster on a CPU for "
                                     "large matrices), by-shape (spectral where it pays); auto: by-shape for fp32 "
                                     "Newton-Schulz on CPUs, iterate on GPUs", choices=NS_METHODS)
    grad_clip: float = setting(1.0, "gradient-norm clipping (0: none)", check=AT_LEAST_0)
    dtype: str = setting("auto", "autocast precision; auto: bf16 on GPUs and CPUs with native bf16 matmuls, "
                                 "else fp32", choices=("auto", "bf16", "fp32"))
    compile: bool = setting(False, "torch.compile the network")
    grad_checkpoint: bool = setting(False, "activation checkpointing per block")
    seed: int = setting(0, "seed of the initialisation, the data order and the noise")
    val_fraction: float = setting(0.02, "share of sequences held out for validation (0: none)", check=UNIT)
    log_every: int = setting(10, "steps per metrics line", check=AT_LEAST_1, mutable=True)
    ckpt_every: int = setting(500, "steps per checkpoint (and one at the end)", check=AT_LEAST_1, mutable=True)
    keep: int = setting(3, "newest checkpoints kept; 0 keeps all of them", check=AT_LEAST_0, mutable=True)
    sample_every: int = setting(0, "print samples of the EMA model every N steps (0: never)", check=AT_LEAST_0,
                                mutable=True)
    sample_steps: int = setting(32, "sampling steps of those samples", check=AT_LEAST_1, mutable=True)
    sample_sampler: str = setting("sde", "sampler of those samples", choices=SAMPLERS, mutable=True)
    sample_omega: float = setting(3.0, "guidance scale of those samples", check=AT_LEAST_0, mutable=True)
    tensorboard: bool = setting(False, "also log to TensorBoard (RUN/tb)", mutable=True)
    task: str | None = setting(None, "a named conditional task, stored with the model (set by --defaults "
                               "wmt14-de-en / xsum)", choices=tuple(PAIR_TASKS))
    source_length: int | None = setting(None, "train on (source, target) pairs whose sources take up to this many "
                                        "tokens; --data is then a .jsonl of pairs, a named task or a hub pair set",
                                        default_help="none: plain text", check=AT_LEAST_1)
    source_field: str = setting("input", "the source field of pair records")
    target_field: str = setting("output", "the target field of pair records")
    epochs: float | None = setting(None, "the run's length in passes over the data (replaces --steps)",
                                   check=POSITIVE)
    warmup_frac: float | None = setting(None, "the warm-up as a fraction of the run (replaces --warmup)", check=UNIT)
    init_from: str | None = setting(None, "start from the weights of this run or checkpoint (its EMA weights; a "
                                    "fresh optimiser, EMA and step 0)", flag="--init-from")
    recipe: dict = setting(help="flow-recipe overrides (elflow.flow.Recipe fields)", cli=False,
                           default_factory=dict)
    model: dict = setting(help="ELFConfig overrides (depth, hidden, heads, ...)", cli=False, default_factory=dict)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """From a stored config; keys it does not know are ignored, missing ones take their defaults (a drawn
        table's stream: 1, the draw of runs stored without one)."""
        names = {f.name for f in fields(cls)}
        return cls(**{"space_stream": 1, **{k: v for k, v in d.items() if k in names}})

    @classmethod
    def named(cls, name: str | None, **overrides) -> "TrainConfig":
        """A named preset of settings (RUN_PRESETS) with `overrides` on top; None: the plain defaults."""
        if name is None:
            return cls(**overrides)
        if name not in RUN_PRESETS:
            raise ELFError(f"unknown settings preset {name!r}; choose one of {', '.join(RUN_PRESETS)}")
        base, derived = RUN_PRESETS[name]
        values = {k: dict(v) if isinstance(v, dict) else v for k, v in {**base, **overrides}.items()}
        for key, fn in derived.items():
            if key not in overrides:
                values[key] = fn(values)
        return cls(**values)

    def resolved(self) -> "TrainConfig":
        """The same run with every preset-dependent default filled in."""
        small = self.preset in ("tiny", "demo")
        space, space_dim = self.space, self.space_dim
        if space is None:
            space = DEFAULT_SPACE.get(self.preset, "t5-small")
            if space_dim is None:
                space_dim = DEFAULT_SPACE_DIM.get(self.preset)
        preset = PRESETS.get(self.preset)
        drawn = space.partition(":")[0] in DRAWN_TABLE_KINDS  # a table drawn from the space seed
        return replace(self, space=space, space_dim=space_dim,
                       space_stream=(self.space_stream or TABLE_STREAM) if drawn else None,
                       ema_decay=self.ema_decay if self.ema_decay is not None else (SMALL_EMA if small else 0.9999),
                       length=self.length if self.length is not None else (preset.max_length if preset else None),
                       lr=self.lr if self.lr is not None else base_lr(self.batch))

    def validate(self) -> None:
        """ELFError naming the first setting out of range (flags spelled as on the command line)."""
        if self.preset not in PRESETS:
            raise ELFError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        for f in fields(self):
            v, meta = getattr(self, f.name), f.metadata
            flag = _flag(f)
            if v is None or isinstance(v, (dict, bool)):
                continue
            if meta.get("choices") and v not in meta["choices"]:
                raise ELFError(f"{flag} must be one of {', '.join(meta['choices'])}, got {v!r}")
            if meta.get("check"):
                ok, what = meta["check"]
                if not isinstance(v, (int, float)) or not ok(v):
                    raise ELFError(f"{flag} must be a number {what}, got {v!r}")
        if self.method != "elf":
            only_elf = [flag for flag, given in (("--source-length", self.source_length), ("--task", self.task),
                                                 ("--init-from", self.init_from),
                                                 ("--grad-checkpoint", self.grad_checkpoint)) if given]
            if only_elf:
                raise ELFError(f"{only_elf[0]} applies to ELF runs only, not to --method {self.method}")
        if self.source_length is not None and self.length is not None and self.source_length >= self.length:
            raise ELFError(f"--source-length {self.source_length} leaves no room for a target in --length "
                           f"{self.length}; use a longer --length or a shorter --source-length")
        for key, (_, _, check, _) in NESTED_FLAGS.items():
            d = getattr(self, key[0])
            if check and key[1] in d and d[key[1]] is not None and not check[0](d[key[1]]):
                raise ELFError(f"--{key[1].replace('_', '-')} must be a number {check[1]}, got {d[key[1]]!r}")


# named presets of settings: (values, settings derived from the others unless given)
RUN_PRESETS: dict[str, tuple[dict, dict]] = {
    # `elflow quickstart`: the demo network on the built-in corpus, tuned on a 2-core CPU (README)
    # (benchmarks/RESULTS.md, section 8): a random table over MiniLM's tokenizer, lr 3e-3, EMA 0.95, and the
    # network options for short runs (docs/method.md)
    "quickstart": (
        dict(preset="demo", data="builtin", space="random-table:minilm", length=64, batch=32, steps=250, lr=3e-3,
             warmup=50, ema_decay=0.95, adam_heads=True, dtype="auto", log_every=10, keep=2, sample_sampler="vc",
             sample_steps=64,
             model={"skip": "gaussian", "time_scale": 1000.0, "head_modulation": True, "table_readout": 1.0}),
        dict(ckpt_every=lambda v: max(v["steps"] // 4, 1), sample_every=lambda v: max(v["steps"] // 4, 1)),
    ),
    # the paper's conditional tasks: ELF-B in T5-small's space, decode corruption 1.0, warm-up 5,000
    **{name: (dict(preset="elf-b", space="t5-small", task=name, data=t["data"], length=t["length"],
                   source_length=t["source_length"], warmup=t["warmup"], layout="document",
                   recipe={"decode_noise_scale": t["decode_noise_scale"]}), {})
       for name, t in PAIR_TASKS.items()},
}

# flags that set one key of a dict setting: (setting, key) -> (type, help, check, default help)
NESTED_FLAGS: dict[tuple[str, str], tuple] = {
    ("model", "depth"): (int, "transformer blocks", AT_LEAST_1, "the preset's"),
    ("model", "hidden"): (int, "hidden width", AT_LEAST_1, "the preset's"),
    ("model", "heads"): (int, "attention heads", AT_LEAST_1, "the preset's"),
    ("model", "skip"): (SKIPS, "denoise head: none = the released networks' x = head(h); gaussian = the data's "
                        "per-dimension Gaussian posterior mean + posterior std x head(h), a network that starts as "
                        "that baseline denoiser; gated = the same with the skip's pass-through of z gated by the "
                        "network (docs/method.md)", None, "the preset's"),
    ("model", "time_scale"): (float, "factor on t before its sinusoid features (1 in the released networks, whose "
                                     "features then barely change over t in [0, 0.1]; DiT uses 1000)", POSITIVE,
                              "the preset's"),
    ("model", "head_modulation"): (bool, "scale and shift the denoise head's input by t (DiT's final layer; "
                                         "absent from the released networks)", None, "the preset's"),
    ("model", "table_readout"): (float, "weight w of the readout's table match: the decode logits gain "
                                        "w z . R_k / sqrt(C), R_k token k's own vector in the space (table spaces "
                                        "only; 0 in the released networks)", AT_LEAST_0, "the preset's"),
    ("recipe", "decode_noise_scale"): (float, "decode corruption scale", POSITIVE, "5; 1 for conditional runs"),
    ("recipe", "decode_clean_prob"): (float, "share of the decode rows' tokens given clean (p = 1) instead of a "
                                             "corrupted level (the released levels put p above 0.95 in 0.4% of "
                                             "draws)", UNIT, "0, as released"),
}

MUTABLE = tuple(f.name for f in fields(TrainConfig) if f.metadata.get("mutable"))


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def _flag(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


# ----------------------------------------------------------------------------------------------------------
# the step


def shard_generators(seed: int, step: int, shard: int, device) -> tuple[torch.Generator, torch.Generator]:
    """(device generator, CPU generator) for one shard of one step, independent of ranks and resumes."""
    s = (seed * 1_000_003 + step) * 4099 + shard
    g = torch.Generator(device=device).manual_seed(s)
    c = torch.Generator().manual_seed(s ^ 0x5DEECE66D)
    return g, c


@dataclass(frozen=True)
class Objective:
    """What a training step minimises. `draw(shape, recipe, generator=, cpu_generator=, device=, conditional=)`
    draws a batch's randomness (with `t`, `decode` and a `drop_source` (B,) CPU bool tensor, read by the
    encoder); `loss(net, x, tokens, draw, recipe, valid=, known=, trained=)` returns (loss, rows) as elf_loss
    does. The default is the ELF objective; distillation passes its own."""

    draw: Callable = draw_training_noise
    loss: Callable = elf_loss


def unwrap(model):
    """(the ELF network, the trained pass) of a network or of its MixedPass under DDP / torch.compile."""
    inner = model.module if hasattr(model, "module") else model
    inner = getattr(inner, "_orig_mod", inner)
    if isinstance(inner, MixedPass):
        return inner.net, model
    return inner, inner.mixed


def step_metrics(loss: torch.Tensor, rows: dict, draw) -> dict:
    """Per-row losses of one shard -> sums and counts (overall, per branch, per time bin) that add up across
    shards, steps and ranks; no host sync."""
    dev = loss.device
    is_dec = draw.decode.to(dev)
    den = (~is_dec).float()
    bins = time_bin(draw.t.detach())
    nb = len(TIME_BINS) - 1
    return {
        "loss": loss.detach(),
        "denoise_sum": rows["denoise"].sum(), "denoise_n": den.sum(),
        "decode_sum": rows["decode"].sum(), "decode_n": is_dec.float().sum(),
        "decode_correct": rows["correct"].sum(), "decode_tokens": rows["scored"].sum(),
        "bin_sum": torch.zeros(nb, device=dev).index_add(0, bins, rows["denoise"] * den),
        "bin_n": torch.zeros(nb, device=dev).index_add(0, bins, den),
    }


def train_step(model, space, shards: list[dict], recipe: Recipe, optimizer: ELFOptimizer, ema: EMA | None,
               step: int, seed: int, first_shard: int, dtype: str = "bf16", grad_clip: float = 1.0,
               world_size: int = 1, device=None, params=None, objective: Objective | None = None) -> dict:
    """One optimiser step over this rank's shards (gradient accumulation); returns metric tensors summed
    over the shards plus the gradient norm. `model` is the network, or its MixedPass (under DDP or
    torch.compile); the loss of each shard is a token mean over its scored positions (flow.token_mean_loss),
    divided by the number of shards of the whole global batch (a mean over micro-batches and ranks)."""
    device = device or next(model.parameters()).device
    net, trained = unwrap(model)
    objective = objective or Objective()
    n_shards = len(shards) * world_size
    totals: dict[str, torch.Tensor] = {}
    for a, batch in enumerate(shards):
        tokens = batch["tokens"].to(device, non_blocking=True)
        mask = batch.get("mask")  # positions scored by the loss
        mask = mask.to(device, non_blocking=True) if mask is not None else None
        attention = batch.get("attention_mask")  # real tokens: the keys the encoder may attend to
        attention = attention.to(device, non_blocking=True) if attention is not None else None
        known = batch.get("known")  # the source positions of conditional data
        known = known.to(device, non_blocking=True) if known is not None else None
        g, c = shard_generators(seed, step, first_shard + a, device)
        B, L = tokens.shape
        draw = objective.draw((B, L, space.dim), recipe, generator=g, cpu_generator=c, device=device,
                              conditional=known is not None)
        if known is not None:
            valid = attention if attention is not None else torch.ones_like(known)
            attention = encoder_mask(known, valid, draw.drop_source)
        sync = a == len(shards) - 1 or not hasattr(model, "no_sync")
        with (nullcontext() if sync else model.no_sync()):
            with autocast(device, dtype):
                with nullcontext() if space.trainable else torch.no_grad():
                    x = space.encode(tokens, attention)
                loss, rows = objective.loss(net, x.float(), tokens, draw, recipe, valid=mask, known=known,
                                            trained=trained)
            (loss / n_shards * world_size).backward()  # DDP averages over ranks: mean over all shards
        for k, v in step_metrics(loss, rows, draw).items():
            totals[k] = totals[k] + v if k in totals else v
    return finish_step(model, net, totals, len(shards), optimizer, ema, grad_clip, params)


class TokenPass(torch.nn.Module):
    """A token-level baseline's loss as a module's forward (for DDP and torch.compile):
    (tokens, mask, generator) -> (loss, metrics) of the method's `loss`."""

    def __init__(self, net, method: str):
        super().__init__()
        self.net = net
        self.loss = get_method(method).loss

    def forward(self, tokens, mask, generator):
        return self.loss(self.net, tokens, mask, generator)


def token_step(model, shards: list[dict], optimizer: ELFOptimizer, ema: EMA | None, step: int, seed: int,
               first_shard: int, dtype: str = "bf16", grad_clip: float = 1.0, world_size: int = 1, device=None,
               params=None) -> dict:
    """One optimiser step of a token-level baseline (`model`: its TokenPass, under DDP / torch.compile or
    not), with the shards, accumulation and per-shard generators of `train_step`. Metrics: the loss, and the
    summed loss terms and scored positions (their ratio is the token-weighted loss)."""
    device = device or next(model.parameters()).device
    inner = model.module if hasattr(model, "module") else model
    net = getattr(inner, "_orig_mod", inner).net
    n_shards = len(shards) * world_size
    totals: dict[str, torch.Tensor] = {}
    for a, batch in enumerate(shards):
        tokens = batch["tokens"].to(device, non_blocking=True)
        mask = batch.get("mask")
        mask = mask.to(device, non_blocking=True) if mask is not None else None
        g, _ = shard_generators(seed, step, first_shard + a, device)
        sync = a == len(shards) - 1 or not hasattr(model, "no_sync")
        with (nullcontext() if sync else model.no_sync()):
            with autocast(device, dtype):
                loss, m = model(tokens, mask, g)
            (loss / n_shards * world_size).backward()
        for k, v in (("loss", loss.detach()), ("nll_sum", m["nll_sum"].float()), ("nll_n", m["tokens"].float())):
            totals[k] = totals[k] + v if k in totals else v
    return finish_step(model, net, totals, len(shards), optimizer, ema, grad_clip, params)


def finish_step(model, net, totals: dict, n_local: int, optimizer, ema, grad_clip: float, params=None) -> dict:
    """Clip, check, step and average: the end of every method's optimiser step (no update if anything is not
    finite)."""
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    totals["grad_norm"] = grad_norm.detach()
    totals["loss"] = totals["loss"] / n_local
    if not torch.isfinite(grad_norm) or not torch.isfinite(totals["loss"]):
        optimizer.zero_grad()
        totals["nonfinite"] = torch.ones(())
        return totals
    optimizer.step()
    optimizer.zero_grad()
    if ema is not None:
        ema.update(net)
    return totals


# ----------------------------------------------------------------------------------------------------------
# set-up helpers


def setup_distributed(device: str | None = None):
    """(rank, world_size, local_rank, device) from torchrun's environment, or a single process on `device`
    (default: cuda when available)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    wants_cpu = device is not None and torch.device(device).type == "cpu"
    if world > 1:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if dist.is_initialized():  # a caller that runs several trainings (distillation's rounds) holds the group
            gpu = dist.get_backend() == "nccl"
            return rank, world, local, torch.device("cuda", local) if gpu else torch.device("cpu")
        if torch.cuda.is_available() and not wants_cpu:
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
            dist.init_process_group("nccl", device_id=dev)
        else:
            dev = torch.device("cpu")
            dist.init_process_group("gloo")
        return rank, world, local, dev
    return 0, 1, 0, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def space_spec(name: str, latent_std, dim: int | None = None, seed: int = 0, stream: int | None = None) -> dict:
    """--space value -> a build_space spec: minilm, t5-small (or any T5 hub id / folder), t5:PATH, hf:PATH,
    or a non-contextual table over a base encoder's vocabulary: token-table[:BASE], random-table[:BASE],
    learned-table[:BASE] (random and learned tables take --space-dim, --space-seed and the stream)."""
    from elflow.encoders import TABLE_KINDS, _normalise_spec

    kind, sep, base = name.partition(":")
    spec = {"kind": kind, "name": base} if sep and kind in TABLE_KINDS else _normalise_spec(name)
    if spec["kind"] in ("random-table", "learned-table"):
        spec.update(seed=seed, stream=stream or TABLE_STREAM, **({"dim": dim} if dim is not None else {}))
    elif dim is not None:
        raise ELFError(f"--space-dim applies to random-table and learned-table spaces, not to {name!r}")
    if latent_std is not None:
        try:
            spec["latent_std"] = latent_std if latent_std in ("auto", "table") else float(latent_std)
        except ValueError:
            raise ELFError(f"--latent-std must be a number, 'auto' or 'table', got {latent_std!r}") from None
    return spec


def on_rank0(fn, rank: int, world: int, device=None):
    """Run `fn` on rank 0 only; every rank raises if it failed there (so that no rank waits for it forever).
    `device`: where the process group's collectives run (a GPU under NCCL)."""
    error = None
    if rank == 0:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (re-raised below, after the other ranks are told)
            error = e
    if world > 1:
        flag = torch.tensor([0.0 if error is None else 1.0], device=device)
        dist.all_reduce(flag)
        if flag.item() and error is None:
            raise ELFError("rank 0 stopped (its message says why)")
    if error is not None:
        raise error


# ----------------------------------------------------------------------------------------------------------
# the run folder


RUN_FILES = ("run.json", "metrics.jsonl", "loss.png", "checkpoints", "tb", "report.json", "samples.jsonl")
REPLACED = ".replaced-run"  # the run that --overwrite replaces, kept until the new run's first checkpoint


class RunFolder:
    """Rank 0's hold on the run folder: its lock, the clean-up of interrupted saves and replacements, and the
    run being replaced, which is set aside and comes back if the new run fails before its first checkpoint."""

    def __init__(self, out: Path, command: str):
        self.out, self.command = out, command
        self.lock = None
        self.created: list[Path] = []
        self.aside = out / REPLACED

    def open(self) -> None:
        p = self.out
        while not p.exists() and p != p.parent:
            self.created.append(p)
            p = p.parent
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ELFError(f"--out {self.out}: cannot create it ({e.strerror or e})") from None
        self.lock = FolderLock(self.out, self.command).acquire()
        self.recover()
        from elflow.checkpoint import remove_stale_temporaries

        for p in remove_stale_temporaries(self.out):
            print(f"removed {p}, left by a save that was interrupted", file=sys.stderr)

    def recover(self) -> None:
        """A replacement interrupted before the new run's first checkpoint: the old run comes back."""
        if not self.aside.is_dir():
            return
        from elflow.checkpoint import list_checkpoints

        if list_checkpoints(self.out):
            shutil.rmtree(self.aside)
        else:
            self._restore_aside()
            print(f"restored the run in {self.out} that an interrupted --overwrite was replacing", file=sys.stderr)

    def set_aside(self) -> None:
        """Move the run's own files (never other files) out of the way of the new run."""
        self.aside.mkdir()
        for name in RUN_FILES:
            if (self.out / name).exists():
                os.rename(self.out / name, self.aside / name)

    def commit(self) -> None:
        """The new run has a checkpoint: the replaced run is dropped."""
        if self.aside.is_dir():
            shutil.rmtree(self.aside)

    def _restore_aside(self) -> None:
        # every run file now in the folder was written by the new run: the old run's were all set aside
        for name in RUN_FILES:
            new = self.out / name
            if new.is_dir():
                shutil.rmtree(new)
            elif new.exists():
                new.unlink()
            if (self.aside / name).exists():
                os.rename(self.aside / name, new)
        self.aside.rmdir()

    def close(self, ok: bool) -> None:
        if self.lock is None:  # the folder was never ours (another command holds it)
            return
        try:
            if not ok and self.aside.is_dir():
                self._restore_aside()
        finally:
            if self.lock is not None:
                self.lock.release()
            if not ok:
                for p in self.created:  # folders this command made, if it left nothing in them
                    try:
                        p.rmdir()
                    except OSError:
                        break


def check_run_dir(out: Path, cfg: TrainConfig, resume: bool, overwrite: bool) -> None:
    """What --resume / --overwrite may do with the folder as it is; the folder is not changed here."""
    ours = {FolderLock.NAME, REPLACED}
    if not (out / "run.json").exists():
        if resume:
            raise ELFError(f"{out} holds no run to resume; check --out, or start the run without --resume")
        if out.is_dir() and any(p.name not in ours for p in out.iterdir()) and not overwrite:
            raise ELFError(f"{out} exists and is not an elflow run folder; choose another --out or pass --overwrite "
                           "(its files are left as they are)")
        return
    if overwrite:
        return
    if not resume:
        raise ELFError(f"{out} already holds a run; pass --resume to continue it or --overwrite to replace it")
    diff = resume_conflicts(stored_config(out), cfg)
    if diff:
        raise ELFError(f"{out} holds a different run ({'; '.join(diff)}); on --resume only "
                       f"{', '.join('--' + k.replace('_', '-') for k in MUTABLE)} may change. Resume it with its "
                       "own settings, or choose another --out")


def stored_config(out: Path) -> TrainConfig:
    """The resolved settings of the run in `out` (of the run an interrupted --overwrite set aside, which the
    next start brings back)."""
    from elflow.checkpoint import list_checkpoints

    src = out
    if (out / REPLACED / "run.json").exists() and not list_checkpoints(out):
        src = out / REPLACED
    try:
        meta = json.loads((src / "run.json").read_text())
        return TrainConfig.from_dict(meta["train"]).resolved()
    except FileNotFoundError:
        raise ELFError(f"{out} holds no run to resume; check --out, or start the run without --resume") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ELFError(f"{out / 'run.json'} cannot be read ({type(e).__name__}: {e})") from None


def resume_conflicts(stored: TrainConfig, cfg: TrainConfig) -> list[str]:
    """'name: stored -> new' for every setting that differs and may not change on resume."""
    a, b = stored.resolved().to_dict(), cfg.resolved().to_dict()
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in a if k not in MUTABLE and a[k] != b[k]]


class RunLogger:
    """Rank 0's output: a progress bar, metrics.jsonl, optional TensorBoard, the loss-curve PNG."""

    def __init__(self, out: Path, total: int, start: int, enabled: bool, tensorboard: bool, show: bool = True):
        self.out, self.enabled, self.show = out, enabled, show
        self.bar = None
        self.tb = None
        if enabled and show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(str(out / "tb"))
                except ImportError:
                    print("warning: TensorBoard is not installed (pip install tensorboard); logging to JSONL only",
                          file=sys.stderr)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])

    def advance(self, n: int, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix(postfix, refresh=False)

    def write(self, msg: str) -> None:
        if self.enabled and self.show:
            (self.bar.write if self.bar is not None else print)(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def plot_losses(run_dir: Path) -> None:
    """loss.png: total, denoise and decode losses, and the denoising loss per time bin."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r.get("kind", "train") == "train"]
    if not recs:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in recs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for key in ("loss", "loss_denoise", "loss_decode", "loss_per_token"):
        ys = [r.get(key) for r in recs]
        pts = [(s, y) for s, y in zip(steps, ys) if y is not None]
        if pts:
            a.plot(*zip(*pts), label=key, lw=1)
    a.set_yscale("log")
    a.set_xlabel("step")
    a.legend()
    a.set_title("training loss")
    for i, label in enumerate(time_bin_labels()):
        key = f"loss_{label}"
        pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        if pts:
            b.plot(*zip(*pts), label=f"t in [{TIME_BINS[i]}, {TIME_BINS[i + 1]})", lw=1)
    if b.lines:  # ELF's denoising loss per time bin (a token-level baseline has none)
        b.set_yscale("log")
        b.legend(fontsize=7)
    b.set_xlabel("step")
    b.set_title("denoising loss per time bin")
    fig.tight_layout()
    with atomic_write(run_dir / "loss.png") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def summarize(totals: dict, n_steps: int) -> dict:
    """Metric tensors summed over steps (and ranks) -> the numbers of one log line."""
    t = {k: v.item() if v.numel() == 1 else v.tolist() for k, v in totals.items()}
    rec = {"loss": t["loss"] / max(n_steps, 1), "grad_norm": t["grad_norm"] / max(n_steps, 1)}
    if "nll_n" in t:  # a token-level baseline: its loss terms per scored position over the logged steps
        rec["loss_per_token"] = t["nll_sum"] / t["nll_n"] if t["nll_n"] else None
        return rec
    if t["denoise_n"]:
        rec["loss_denoise"] = t["denoise_sum"] / t["denoise_n"]
    if t["decode_n"]:
        rec["loss_decode"] = t["decode_sum"] / t["decode_n"]
    if t["decode_tokens"]:
        rec["decode_acc"] = t["decode_correct"] / t["decode_tokens"]
    for i, (s, n) in enumerate(zip(t["bin_sum"], t["bin_n"])):
        rec[f"loss_{time_bin_labels()[i]}"] = s / n if n else None
    return rec


# ----------------------------------------------------------------------------------------------------------
# setup, restore and save


@dataclass
class Setup:
    """The objects of one run, built and checked before anything is written."""

    cfg: TrainConfig
    method: str  # "elf", "ar" or "mdlm"
    params: dict  # {"model": its count, "elf": the ELF network's count it is matched to, "match"}
    rank: int
    world: int
    local: int
    device: torch.device
    micro: int
    accum: int
    length: int
    dtype: str  # "bf16" or "fp32" (cfg.dtype resolved for the device)
    space: object
    net: ELF
    mcfg: object
    recipe: Recipe
    named: list
    lr: float
    optimizer: ELFOptimizer
    ema: EMA
    batches: object
    steps: int  # the schedule's length (cfg.steps, or cfg.epochs passes over the data)
    warmup: int

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.lr, self.warmup, self.cfg.lr_decay, self.steps)


def setup_run(cfg: TrainConfig, rank: int, world: int, local: int, device, cache_dir=None) -> Setup:
    """Build the space, the data, the network and the optimiser: every check that needs them happens here."""
    from elflow.data import Batches, build_dataset
    from elflow.encoders import build_space, latent_moments, token_vectors

    micro = cfg.micro_batch or max(1, cfg.batch // world)
    if cfg.batch % (world * micro):
        raise ELFError(f"--batch {cfg.batch} is not divisible by world size {world} x --micro-batch {micro}; "
                       f"choose a batch that is a multiple of {world * micro}")
    accum = cfg.batch // (world * micro)
    torch.manual_seed(cfg.seed)
    spec = space_spec(cfg.space, cfg.latent_std, cfg.space_dim, cfg.space_seed, cfg.space_stream)
    # a baseline reads the space's token ids only: its tokenizer, without the encoder
    space = build_space(spec if cfg.method == "elf" else {"kind": "tokens", "of": spec}, device=device)
    length = cfg.length
    if space.max_length is not None and length > space.max_length:
        raise ELFError(f"--length {length} is longer than the encoder accepts ({space.max_length})")
    if cfg.source_length:
        from elflow.data import build_pairs

        train_set, _ = build_pairs(cfg.data, space, cfg.source_length, length, val_fraction=cfg.val_fraction,
                                   seed=cfg.seed, cache_dir=cache_dir, source_field=cfg.source_field,
                                   target_field=cfg.target_field, on_bad=cfg.on_bad)
    else:
        train_set, _ = build_dataset(cfg.data, space, length, layout=cfg.layout, val_fraction=cfg.val_fraction,
                                     seed=cfg.seed, cache_dir=cache_dir, field=cfg.text_field, on_bad=cfg.on_bad)
    try:
        mcfg = get_config(cfg.preset, dim=space.dim, vocab_size=space.vocab_size, max_length=length,
                          grad_checkpoint=cfg.grad_checkpoint, **cfg.model)
    except (TypeError, ValueError) as e:
        raise ELFError(f"the network settings do not fit together: {e}") from None
    recipe = Recipe.from_dict({"decode_noise_scale": 1.0, **cfg.recipe} if cfg.source_length else cfg.recipe)
    if cfg.method == "elf":
        net = ELF(mcfg).to(device)
        if mcfg.skip != "none":  # the Gaussian model's moments, from the training split
            net.set_gaussian_skip(*latent_moments(space, train_set, device=device), recipe.noise_scale)
        if mcfg.table_readout:  # each token's own vector, for the decode readout
            net.set_readout_table(token_vectors(space, mcfg.vocab_size, device=device))
        params = {"model": net.num_params(), "elf": net.num_params(), "match": cfg.match}
        # the optimiser names a trainable space's parameters "space.<name>" beside the network's
        named = list(net.named_parameters()) + [("space." + n, p) for n, p in space.named_parameters()
                                                if p.requires_grad]
        optimizer = ELFOptimizer(named, lr=cfg.lr, adam_heads=cfg.adam_heads, ns_method=cfg.ns_method)
    else:
        shape, target = fit_shape(cfg.method, mcfg, space, cfg.match)
        torch.manual_seed(cfg.seed)
        net = get_method(cfg.method).build(shape, space).to(device)
        mcfg = net.config
        params = {"model": num_params(net), "elf": target, "match": cfg.match}
        named = list(net.named_parameters())
        # Muon on the blocks' matrices; the token table (an embedding lookup, no matrix map) on Adam
        optimizer = ELFOptimizer(named, lr=cfg.lr, adam=table_names(net), ns_method=cfg.ns_method)
    ema = EMA(net, cfg.ema_decay)
    batches = Batches(train_set, micro * accum, seed=cfg.seed, rank=rank, world_size=world)
    steps = cfg.steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * batches.per_epoch))
    warmup = cfg.warmup if cfg.warmup_frac is None else math.ceil(cfg.warmup_frac * steps)
    return Setup(cfg, cfg.method, params, rank, world, local, device, micro, accum, length,
                 resolve_dtype(cfg.dtype, device), space, net, mcfg, recipe, named, cfg.lr, optimizer, ema, batches,
                 steps, warmup)


def start_from(run: Setup, path, quiet: bool = False) -> None:
    """Load stored weights into a fresh run (`--init-from`): its EMA starts from them; the optimiser is new."""
    init_cfg, init_sd, info = load_init_weights(path, warn=lambda m: run.rank == 0 and print(m, file=sys.stderr))
    check_init_compatible(path, init_cfg, info, run.mcfg, run.space)
    run.net.load_state_dict(init_sd)
    run.ema = EMA(run.net, run.cfg.ema_decay)
    if run.rank == 0 and not quiet:
        print(f"starting from the weights of {info['checkpoint']}", file=sys.stderr)


def load_init_weights(path, warn=None):
    """(ELFConfig, state dict, info) of the weights a run starts from: the EMA of an elflow run or checkpoint
    (or of an authors' checkpoint). Where no EMA was stored, the trained weights, with a warning."""
    from elflow.checkpoint import read_weights

    cfg, sd, spec, recipe, info = read_weights(path, use_ema=True)
    if not sd:
        (warn or (lambda m: print(m, file=sys.stderr)))(
            f"warning: {path} holds no EMA weights; using its trained (raw) weights instead")
        cfg, sd, spec, recipe, info = read_weights(path, use_ema=False)
        info = {**info, "ema": False}
    return cfg, sd, {**info, "space": spec, "recipe": recipe}


SHAPE_FREE = ("max_length", "grad_checkpoint")  # ELFConfig fields that do not change the weights


def check_init_compatible(path, init_cfg, info: dict, mcfg, space) -> None:
    """Refuse starting weights of another embedding space or another network shape."""
    stored = info.get("space_id")
    if stored and stored != space.space_id:
        raise ELFError(f"{path} was trained in the embedding space {stored!r}, this run uses {space.space_id!r}; "
                       "pass the matching --space / --latent-std")
    a, b = init_cfg.to_dict(), mcfg.to_dict()
    diff = [f"{k} {a[k]} vs {b[k]}" for k in a if k not in SHAPE_FREE and a[k] != b.get(k)]
    if diff:
        raise ELFError(f"{path} holds a network of another shape than this run's ({', '.join(diff)})")


def restore(run: Setup, out: Path, quiet: bool = False) -> int:
    """Load the newest good checkpoint of `out` into the run; returns its step (0 when there is none)."""
    from safetensors.torch import load_file

    from elflow.checkpoint import latest_checkpoint, load_checkpoint, split_space_state
    from elflow.encoders import check_compatible

    is_main = run.rank == 0
    ckpt = latest_checkpoint(out, warn=lambda m: is_main and print(m, file=sys.stderr))
    if ckpt is None:
        return 0
    blob = load_checkpoint(ckpt, map_location=run.device)
    check_compatible(blob["state"]["space_id"], run.space)
    net_sd, space_sd = split_space_state(blob["model"])  # checkpoints that keep the space in model.safetensors
    if (ckpt / "space.safetensors").exists():
        space_sd = load_file(ckpt / "space.safetensors", device=str(run.device))
    run.net.load_state_dict(net_sd)
    if space_sd or run.space.trainable:
        run.space.load_trainable_state_dict(space_sd)
    run.ema.load_state_dict(blob["ema"])
    run.optimizer.load_state_dict(blob["optimizer"]["optimizer"])
    torch.set_rng_state(blob["optimizer"]["rng"]["torch"].cpu())
    if "cuda" in blob["optimizer"]["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(blob["optimizer"]["rng"]["cuda"].cpu())
    run.batches.load_state_dict(blob["state"]["data_position"])
    start = blob["state"]["step"]
    if is_main and not quiet:
        print(f"resuming from {ckpt} (step {start})", file=sys.stderr)
    return start


def save_run_checkpoint(out: Path, step: int, run: Setup) -> Path:
    from elflow.checkpoint import save_checkpoint

    cfg = run.cfg
    state = {"format": "elflow-checkpoint-1", "method": run.method, "params": run.params,
             "train": cfg.to_dict(), "model": run.mcfg.to_dict(),
             "space": run.space.config(), "space_id": run.space.space_id, "data_position": run.batches.state_dict(),
             "world_size": run.world, "settings": model_settings(run)}
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return save_checkpoint(out, step, run.net.state_dict(), run.ema.state_dict(),
                           {"optimizer": run.optimizer.state_dict(), "rng": rng}, state, keep=cfg.keep,
                           space_sd=run.space.trainable_state_dict())


def model_settings(run: Setup) -> dict:
    """What a user of the model needs to know without flags: its length, and for a conditional model its
    source length, task and sampling defaults."""
    cfg = run.cfg
    out = {"length": run.length}
    if cfg.source_length:
        from elflow.checkpoint import CONDITIONAL_SAMPLING

        out.update(source_length=cfg.source_length, sampling=dict(CONDITIONAL_SAMPLING))
        if cfg.task:
            out["task"] = cfg.task
    return out


def _no_space(e: OSError, out: Path) -> ELFError:
    from elflow.checkpoint import list_checkpoints

    good = list_checkpoints(out)
    last = f"step {int(good[-1].name[5:])}" if good else "none"
    return ELFError(f"no space left on device: {e.filename or out}; last good checkpoint: {last}; free some space, "
                    "then run again with --resume")


# ----------------------------------------------------------------------------------------------------------
# the loop


def train_loop(run: Setup, out: Path, start: int, quiet: bool = False, stop_after: int | None = None,
               on_checkpoint=None, objective: Objective | None = None, time_limit: float | None = None) -> dict:
    """Steps start .. end of the schedule; rank 0 logs and saves. `on_checkpoint(path)` follows each save.
    `time_limit` (seconds): end (with a checkpoint) after the first step that finishes past it."""
    cfg, world, rank, device, micro = run.cfg, run.world, run.rank, run.device, run.micro
    is_main = rank == 0
    elf = run.method == "elf"
    # the trained pass as a module's forward, for torch.compile and DDP
    model = MixedPass(run.net) if elf else TokenPass(run.net, run.method)
    if cfg.compile:
        model = torch.compile(model)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # the only buffers are constant RoPE tables: no per-forward broadcast (forward counts differ by rank)
        model = DDP(model, device_ids=[run.local] if device.type == "cuda" else None, broadcast_buffers=False)
    params = [p for _, p in run.named]
    log = RunLogger(out, run.steps, start, is_main, cfg.tensorboard, show=not quiet)
    tokens_per_step = cfg.batch * run.length
    totals, n_logged, t_log = {}, 0, time.perf_counter()
    last_good = None
    end = run.steps if stop_after is None else min(run.steps, start + stop_after)
    summary = {"start_step": start}
    t_start = time.perf_counter()
    try:
        for step in range(start, end):
            run.optimizer.set_lr(run.lr_at(step))
            global_batch = next(run.batches)
            shards = [{k: (v[a * micro:(a + 1) * micro] if torch.is_tensor(v) else v)
                       for k, v in global_batch.items()} for a in range(run.accum)]
            if elf:
                m = train_step(model, run.space, shards, run.recipe, run.optimizer, run.ema, step, cfg.seed,
                               rank * run.accum, run.dtype, cfg.grad_clip, world, device, params, objective)
            else:
                m = token_step(model, shards, run.optimizer, run.ema, step, cfg.seed, rank * run.accum, run.dtype,
                               cfg.grad_clip, world, device, params)
            nonfinite = m.pop("nonfinite", None)
            if world > 1:
                flag = torch.tensor([1.0 if nonfinite is not None else 0.0], device=device)
                dist.all_reduce(flag)
                nonfinite = flag.item() > 0 or None
            if nonfinite is not None:
                msg = (f"non-finite loss or gradient at step {step}; stopping without saving. "
                       f"The last good checkpoint is {last_good or 'none (no checkpoint was saved yet)'}; "
                       "try a lower --lr or --dtype fp32, then --resume.")
                raise ELFError(msg)
            for k, v in m.items():
                totals[k] = totals[k] + v if k in totals else v
            n_logged += 1
            done = step + 1
            if time_limit is not None and done < end:
                over = torch.tensor([float(time.perf_counter() - t_start >= time_limit)], device=device)
                if world > 1:  # every rank stops at the same step
                    dist.all_reduce(over, op=dist.ReduceOp.MAX)
                if over.item():
                    end = done
            if done % cfg.log_every == 0 or done == end:
                if world > 1:
                    keys = sorted(totals)
                    flat = torch.cat([totals[k].reshape(-1).float() for k in keys])
                    dist.all_reduce(flat)
                    sizes = [totals[k].numel() for k in keys]
                    parts = flat.split(sizes)
                    totals = {k: p.reshape(totals[k].shape) / (world if k in ("loss", "grad_norm") else 1)
                              for k, p in zip(keys, parts)}
                rec = summarize(totals, n_logged)
                dt = time.perf_counter() - t_log
                rec.update(step=done, lr=run.lr_at(step),
                           tokens_per_s=tokens_per_step * n_logged / dt, elapsed=dt)
                log.log({"kind": "train", **rec})
                log.advance(n_logged, {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"})
                summary["last"] = rec
                totals, n_logged, t_log = {}, 0, time.perf_counter()
            if cfg.sample_every and done % cfg.sample_every == 0 and is_main and not quiet:
                show_samples(run, log, done)
            if (done % cfg.ckpt_every == 0 or done == end) and is_main:
                last_good = save_run_checkpoint(out, done, run)
                if on_checkpoint is not None:
                    on_checkpoint(last_good)
                plot_losses(out)
            if world > 1 and (done % cfg.ckpt_every == 0 or done == end):
                dist.barrier()
            if done == end:
                break
    except OSError as e:
        if no_space_error(e):
            raise _no_space(e, out) from None
        raise
    finally:
        log.close()
    summary.update(end_step=end, out=str(out))
    return summary


def train(cfg: TrainConfig, out: str | os.PathLike, resume: bool = False, overwrite: bool = False,
          cache_dir=None, quiet: bool = False, stop_after: int | None = None, device: str | None = None,
          command: str = "elflow train", objective: Objective | None = None, time_limit: float | None = None) -> dict:
    """Train; returns a summary dict (rank 0). `stop_after` ends the process's work after that many steps
    of this invocation (for tests and time-boxed runs) while keeping the schedule of `cfg.steps`.

    Everything is checked before the run folder changes; --overwrite sets the old run aside and drops it
    only once the new run's first checkpoint is written (it comes back if the new run fails before).
    `objective` replaces the ELF loss (distillation); `cfg.init_from` starts a fresh run from stored weights.
    `time_limit` (seconds) ends this invocation after the first step past it (a wall-clock budget)."""
    out = Path(out)
    cfg = cfg.resolved()
    cfg.validate()
    device = check_device(device)
    check_output(out, folder=True)
    owns_group = not dist.is_initialized()
    rank, world, local, dev = setup_distributed(device)
    folder = RunFolder(out, command)
    ok = False
    try:
        on_rank0(folder.open, rank, world, dev)
        check_run_dir(out, cfg, resume, overwrite)
        if rank == 0 and cfg.epochs is None and cfg.warmup_frac is None and cfg.steps < cfg.warmup:
            print(f"warning: --steps {cfg.steps} is shorter than --warmup {cfg.warmup}: the learning rate stops at "
                  f"{lr_at(cfg.steps - 1, cfg.lr, cfg.warmup):.3g}, never reaching {cfg.lr:.3g}", file=sys.stderr)
        run = setup_run(cfg, rank, world, local, dev, cache_dir)
        if overwrite and (out / "run.json").exists():
            on_rank0(folder.set_aside, rank, world, dev)
        start = restore(run, out, quiet) if resume else 0
        if start == 0 and cfg.init_from:
            start_from(run, cfg.init_from, quiet)

        def write_meta():
            atomic_write_json(out / "run.json", {"train": cfg.to_dict(), "method": cfg.method,
                                                 "model": run.mcfg.to_dict(), "params": run.params,
                                                 "space": run.space.config(), "space_id": run.space.space_id,
                                                 "world_size": world})

        try:
            on_rank0(write_meta, rank, world, dev)
        except OSError as e:
            if no_space_error(e):
                raise _no_space(e, out) from None
            raise
        if objective is not None and cfg.method != "elf":
            raise ELFError(f"a training objective replaces ELF's loss; --method {cfg.method} has its own")
        summary = train_loop(run, out, start, quiet, stop_after, on_checkpoint=lambda _: folder.commit(),
                             objective=objective, time_limit=time_limit)
        ok = True
        return summary
    finally:
        if rank == 0:
            folder.close(ok)
        if world > 1 and dist.is_initialized() and owns_group:
            dist.destroy_process_group()


@torch.no_grad()
def show_samples(run: Setup, log, step, num: int = 2):
    from elflow.flow import generate_tokens

    net, cfg = run.net, run.cfg
    if run.method != "elf":
        from elflow.methods import sample_texts, sampling_settings

        module = get_method(run.method)
        sampler_net = module.build(net.config, run.space).to(next(net.parameters()).device)
        run.ema.copy_to(sampler_net)
        settings = sampling_settings(run.method, steps=cfg.sample_steps if run.method == "mdlm" else None)
        texts = sample_texts(run.method, sampler_net, run.space, num, run.length, settings.settings(), cfg.seed)
    else:
        sampler_net = ELF(net.config).to(next(net.parameters()).device)
        run.ema.copy_to(sampler_net)
        sampler_net.eval()
        g = torch.Generator(device=next(net.parameters()).device).manual_seed(cfg.seed)
        tokens, _ = generate_tokens(sampler_net, num, run.length, cfg.sample_steps, cfg.sample_sampler,
                                    omega=cfg.sample_omega, generator=g)
        texts = run.space.decode(tokens.cpu())
    for i, text in enumerate(texts):
        log.write(f"[step {step}] sample {i}: {text[:300]}")


# ----------------------------------------------------------------------------------------------------------
# CLI: one flag per TrainConfig field, plus the flags that say where and how to run


_TYPES = {"str": str, "str | None": str, "int": int, "int | None": int, "float": float, "float | None": float}


def _help(text: str, default_text) -> str:
    return f"{text} (default: {default_text})".replace("%", "%%")


def add_arguments(p) -> None:
    # every flag defaults to "not given" so that --resume can tell what the command line changes
    S = argparse.SUPPRESS
    cfg_group = p.add_argument_group("run settings (stored with the run; --print-config shows them resolved)")
    for f in fields(TrainConfig):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        default_text = meta.get("default_help") or (f.default if f.default is not None else "none")
        kw = dict(default=S, dest=f.name, help=_help(meta["help"], default_text))
        if f.type == "bool":
            kw["help"] = _help(meta["help"], "on" if f.default else "off")
            cfg_group.add_argument(_flag(f), action=argparse.BooleanOptionalAction, **kw)
            continue
        kw["type"] = _TYPES[f.type]
        if meta.get("choices"):
            kw["choices"] = meta["choices"]
        else:
            kw["metavar"] = _flag(f)[2:].upper().replace("-", "_")
        cfg_group.add_argument(_flag(f), **kw)
    for (key, sub), (typ, text, _, default_text) in NESTED_FLAGS.items():
        if isinstance(typ, tuple):
            kind = {"choices": typ}
        elif typ is bool:
            kind = {"type": _true_or_false, "metavar": "true|false"}
        else:
            kind = {"type": typ, "metavar": sub.upper()}
        cfg_group.add_argument("--" + sub.replace("_", "-"), default=S, dest=f"{key}.{sub}", **kind,
                               help=_help(text, default_text))
    cfg_group.add_argument("--defaults", default=S, choices=tuple(RUN_PRESETS),
                           help=_help("start from a named set of settings (quickstart: what `elflow quickstart` "
                                      "trains); other flags override it", "none"))
    g = p.add_argument_group("where and how to run")
    g.add_argument("--out", default=S, help=_help("run folder", "runs/<preset>"))
    g.add_argument("--resume", action="store_true", default=S,
                   help="continue the run in --out from its last good checkpoint, with its stored settings; flags "
                        f"may change only {', '.join('--' + k.replace('_', '-') for k in MUTABLE)}")
    g.add_argument("--overwrite", action="store_true", default=S,
                   help="replace the run in --out; the old run is kept until the new run's first checkpoint is "
                        "written, and other files in the folder are left alone")
    g.add_argument("--device", default=S, help=_help("cpu or cuda; under torchrun each rank takes its GPU",
                                                     "cuda when available"))
    g.add_argument("--cache-dir", default=S, help=_help("tokenization and download cache",
                                                        "$ELFLOW_CACHE or ~/.cache/elflow"))
    g.add_argument("--quiet", action="store_true", default=S, help="no progress bar, samples or resume notes")
    g.add_argument("--print-config", action="store_true", default=S,
                   help="print the resolved settings as JSON and exit without training")


def given_settings(args) -> dict:
    """The TrainConfig values given on the command line (nested flags merged into their dicts)."""
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    for key, sub in NESTED_FLAGS:
        if hasattr(args, f"{key}.{sub}"):
            given.setdefault(key, {})[sub] = getattr(args, f"{key}.{sub}")
    return given


def config_from_args(args) -> TrainConfig:
    """The run's settings: the stored ones on --resume (with the changes the command line may make), else the
    command line over the defaults (or over --defaults NAME); resolved and checked."""
    given = given_settings(args)
    if getattr(args, "resume", False):
        if hasattr(args, "defaults"):
            raise ELFError("--defaults does not go with --resume: a resumed run keeps its stored settings")
        out = Path(getattr(args, "out", None) or f"runs/{given.get('preset', TrainConfig.preset)}")
        stored = stored_config(out)
        merged = {**stored.to_dict()}
        for k, v in given.items():
            merged[k] = {**merged[k], **v} if isinstance(v, dict) else v
        cfg = TrainConfig(**merged).resolved()
        diff = resume_conflicts(stored, cfg)
        if diff:
            raise ELFError(f"on --resume only {', '.join('--' + k.replace('_', '-') for k in MUTABLE)} may change; "
                           f"the command line changes {'; '.join(diff)}. Drop those flags, or start a new run in "
                           "another --out")
    else:
        cfg = TrainConfig.named(getattr(args, "defaults", None), **given).resolved()
    cfg.validate()
    return cfg


def run(args) -> int:
    cfg = config_from_args(args)
    if getattr(args, "print_config", False):
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    out = getattr(args, "out", None) or f"runs/{cfg.preset}"
    command = "elflow train " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["train"] else "elflow train"
    summary = train(cfg, out, resume=getattr(args, "resume", False), overwrite=getattr(args, "overwrite", False),
                    cache_dir=getattr(args, "cache_dir", None), quiet=getattr(args, "quiet", False),
                    device=getattr(args, "device", None), command=command)
    if summary.get("last"):
        print(f"done: step {summary['end_step']}, loss {summary['last']['loss']:.4f}; run folder {out}")
    return 0
