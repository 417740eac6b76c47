"""`elflow train`: one entry point, alone or under torchrun (DDP: NCCL on GPUs, Gloo on CPUs).

A global batch of `--batch` rows is cut into shards of `--micro-batch` rows: rank r runs shards
r*A .. r*A + A - 1 (A = accumulation steps). Each shard draws its noise from a generator seeded by
(seed, step, shard), so a run's numbers depend on the global batch only, not on how it is spread over
ranks and accumulation steps, and a resumed run needs no generator state to continue exactly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from elflow.data import encoder_mask
from elflow.flow import TIME_BINS, Recipe, draw_training_noise, elf_loss, time_bin, time_bin_labels
from elflow.model import ELF, PRESETS, MixedPass, get_config
from elflow.optim import EMA, NS_METHODS, ELFOptimizer, base_lr, lr_at
from elflow.utils import ELFError, atomic_write, atomic_write_json

__all__ = ["TrainConfig", "Objective", "train", "train_step", "shard_generators", "load_init_weights",
           "add_arguments", "run"]

# the default embedding space of each preset
DEFAULT_SPACE = {"tiny": "minilm", "demo": "minilm"}


@dataclass
class TrainConfig:
    """Everything a run needs besides the network shape; stored in every checkpoint."""

    preset: str = "demo"
    data: str = "builtin"
    text_field: str = "text"
    on_bad: str = "stop"  # empty / binary / non-UTF-8 files and bad jsonl lines: stop, or skip with a warning
    space: str = "minilm"
    latent_std: str | None = None  # a number, "auto", or None for the space's default
    length: int | None = None  # defaults to the preset's max_length
    layout: str = "packed"
    batch: int = 32  # global batch (rows per optimiser step, over all ranks)
    micro_batch: int | None = None  # rows per forward/backward; batch / (world * micro) accumulation steps
    steps: int = 1000
    epochs: float | None = None  # if set, the run's length in passes over the data (overrides steps)
    lr: float | None = None  # default 1e-3 * batch / 256
    warmup: int = 100
    warmup_frac: float | None = None  # if set, the warm-up as a fraction of the run (overrides warmup)
    ema_decay: float = 0.9999
    adam_heads: bool = False
    ns_method: str = "auto"  # how Muon's Newton-Schulz is evaluated: auto, iterate, spectral, by-shape
    grad_clip: float = 1.0
    dtype: str = "auto"  # autocast dtype: bf16, fp32, or auto (bf16 where bf16 matmuls are fast)
    compile: bool = False
    grad_checkpoint: bool = False
    seed: int = 0
    val_fraction: float = 0.02
    log_every: int = 10
    ckpt_every: int = 500
    keep: int = 3
    sample_every: int = 0
    sample_steps: int = 32
    sample_sampler: str = "sde"
    sample_omega: float = 3.0
    tensorboard: bool = False
    recipe: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # ELFConfig overrides (depth, hidden, heads, ...)
    init_from: str | None = None  # start from these weights (a run or checkpoint: its EMA), fresh optimiser

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# ----------------------------------------------------------------------------------------------------------
# the step


def shard_generators(seed: int, step: int, shard: int, device) -> tuple[torch.Generator, torch.Generator]:
    """(device generator, CPU generator) for one shard of one step, independent of ranks and resumes."""
    s = (seed * 1_000_003 + step) * 4099 + shard
    g = torch.Generator(device=device).manual_seed(s)
    c = torch.Generator().manual_seed(s ^ 0x5DEECE66D)
    return g, c


def resolve_dtype(dtype: str, device) -> str:
    """"auto" -> bf16 on GPUs and CPUs with native bf16 matmuls (AMX, AVX512-BF16), fp32 elsewhere."""
    from elflow.optim import fast_bf16

    return ("bf16" if fast_bf16(device) else "fp32") if dtype == "auto" else dtype


def autocast_ctx(device: torch.device, dtype: str):
    if resolve_dtype(dtype, device) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


@dataclass(frozen=True)
class Objective:
    """What a training step minimises. `draw(shape, recipe, generator=, cpu_generator=, device=, conditional=)`
    draws a batch's randomness (with `t`, `decode` and a `drop_source` (B,) CPU bool tensor, read by the
    encoder); `loss(net, x, tokens, draw, recipe, valid=, known=, trained=)` returns (loss, rows) as elf_loss
    does. The default is the ELF objective; distillation passes its own."""

    draw: Callable = draw_training_noise
    loss: Callable = elf_loss


def train_step(model, space, shards: list[dict], recipe: Recipe, optimizer: ELFOptimizer, ema: EMA | None,
               step: int, seed: int, first_shard: int, dtype: str = "bf16", grad_clip: float = 1.0,
               world_size: int = 1, device=None, params=None, objective: Objective | None = None) -> dict:
    """One optimiser step over this rank's shards (gradient accumulation); returns metric tensors summed
    over the shards plus the gradient norm. `model` may be a DDP wrapper; the loss of each shard is a mean
    over its rows, divided by the number of shards of the whole global batch."""
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
            with autocast_ctx(device, dtype):
                with nullcontext() if space.trainable else torch.no_grad():
                    x = space.encode(tokens, attention)
                loss, rows = objective.loss(net, x.float(), tokens, draw, recipe, valid=mask, known=known,
                                            trained=trained)
            (loss / n_shards * world_size).backward()  # DDP averages over ranks: mean over all shards
        for k, v in step_metrics(loss, rows, draw).items():
            totals[k] = totals[k] + v if k in totals else v
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    totals["grad_norm"] = grad_norm.detach()
    totals["loss"] = totals["loss"] / len(shards)
    if not torch.isfinite(grad_norm) or not torch.isfinite(totals["loss"]):
        optimizer.zero_grad()
        totals["nonfinite"] = torch.ones(())
        return totals
    optimizer.step()
    optimizer.zero_grad()
    if ema is not None:
        ema.update(net)
    return totals


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


# ----------------------------------------------------------------------------------------------------------
# set-up helpers


def setup_distributed():
    """(rank, world_size, local_rank, device) from torchrun's environment, or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        return rank, world, local, device
    return 0, 1, 0, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def space_spec(name: str, latent_std) -> dict:
    """--space value -> a build_space spec: minilm, t5-small (or any T5 hub id / folder), t5:PATH, hf:PATH,
    or a non-contextual table over a base encoder's vocabulary: token-table[:BASE], random-table[:BASE],
    learned-table[:BASE]."""
    from elflow.encoders import TABLE_KINDS, _normalise_spec

    kind, sep, base = name.partition(":")
    spec = {"kind": kind, "name": base} if sep and kind in TABLE_KINDS else _normalise_spec(name)
    if latent_std is not None:
        try:
            spec["latent_std"] = latent_std if latent_std in ("auto", "table") else float(latent_std)
        except ValueError:
            raise ELFError(f"--latent-std must be a number, 'auto' or 'table', got {latent_std!r}") from None
    return spec


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


def trainable_space_params(space) -> dict:
    return {"space." + n: p for n, p in space.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------------------------------------
# the run


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
                    print("warning: TensorBoard is not installed (pip install tensorboard); logging to JSONL only")

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
    for key in ("loss", "loss_denoise", "loss_decode"):
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
    b.set_yscale("log")
    b.set_xlabel("step")
    b.legend(fontsize=7)
    b.set_title("denoising loss per time bin")
    fig.tight_layout()
    with atomic_write(run_dir / "loss.png") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def summarize(totals: dict, n_steps: int) -> dict:
    """Metric tensors summed over steps (and ranks) -> the numbers of one log line."""
    t = {k: v.item() if v.numel() == 1 else v.tolist() for k, v in totals.items()}
    rec = {"loss": t["loss"] / max(n_steps, 1), "grad_norm": t["grad_norm"] / max(n_steps, 1)}
    if t["denoise_n"]:
        rec["loss_denoise"] = t["denoise_sum"] / t["denoise_n"]
    if t["decode_n"]:
        rec["loss_decode"] = t["decode_sum"] / t["decode_n"]
    if t["decode_tokens"]:
        rec["decode_acc"] = t["decode_correct"] / t["decode_tokens"]
    for i, (s, n) in enumerate(zip(t["bin_sum"], t["bin_n"])):
        rec[f"loss_{time_bin_labels()[i]}"] = s / n if n else None
    return rec


def check_run_dir(out: Path, cfg: TrainConfig, resume: bool, overwrite: bool, is_main: bool) -> None:
    existing = out / "run.json"
    if not existing.exists():
        if out.exists() and any(out.iterdir()) and not (resume or overwrite):
            raise ELFError(f"{out} exists and is not an elflow run folder; choose another --out or pass --overwrite")
        return
    if overwrite:
        if is_main:
            shutil.rmtree(out)
        return
    if not resume:
        raise ELFError(f"{out} already holds a run; pass --resume to continue it or --overwrite to replace it")
    stored = json.loads(existing.read_text())["train"]
    keys = ("preset", "space", "length", "layout", "batch", "model", "data", "latent_std")
    diff = [f"{k}: {stored.get(k)!r} -> {cfg.to_dict().get(k)!r}" for k in keys if stored.get(k) != cfg.to_dict().get(k)]
    if diff:
        raise ELFError(f"{out} holds a different run ({'; '.join(diff)}); resume it with its own settings, "
                       "or choose another --out")


def train(cfg: TrainConfig, out: str | os.PathLike, resume: bool = False, overwrite: bool = False,
          cache_dir=None, quiet: bool = False, stop_after: int | None = None,
          objective: Objective | None = None) -> dict:
    """Train; returns a summary dict (rank 0). `stop_after` ends the process's work after that many steps
    of this invocation (for tests and time-boxed runs) while keeping the schedule of `cfg.steps`.
    `objective` replaces the ELF loss (distillation); `cfg.init_from` starts a fresh run from stored weights."""
    from elflow.data import Batches, build_dataset
    from elflow.encoders import build_space, check_compatible

    out = Path(out)
    rank, world, local, device = setup_distributed()
    is_main = rank == 0
    try:
        if cfg.preset not in PRESETS:
            raise ELFError(f"unknown preset {cfg.preset!r}; choose one of {', '.join(PRESETS)}")
        micro = cfg.micro_batch or max(1, cfg.batch // world)
        if cfg.batch % (world * micro):
            raise ELFError(f"--batch {cfg.batch} is not divisible by world size {world} x --micro-batch {micro}; "
                           f"choose a batch that is a multiple of {world * micro}")
        accum = cfg.batch // (world * micro)
        check_run_dir(out, cfg, resume, overwrite, is_main)
        if world > 1:
            dist.barrier()

        torch.manual_seed(cfg.seed)
        space = build_space(space_spec(cfg.space, cfg.latent_std), device=device)
        length = cfg.length or PRESETS[cfg.preset].max_length
        if space.max_length is not None and length > space.max_length:
            raise ELFError(f"--length {length} is longer than the encoder accepts ({space.max_length})")
        train_set, val_set = build_dataset(cfg.data, space, length, layout=cfg.layout, val_fraction=cfg.val_fraction,
                                           seed=cfg.seed, cache_dir=cache_dir, field=cfg.text_field,
                                           on_bad=cfg.on_bad)
        mcfg = get_config(cfg.preset, dim=space.dim, vocab_size=space.vocab_size, max_length=length,
                          grad_checkpoint=cfg.grad_checkpoint, **cfg.model)
        recipe = Recipe.from_dict(cfg.recipe)
        net = ELF(mcfg).to(device)
        resume_from = None
        if resume and (out / "checkpoints").exists():
            from elflow.checkpoint import latest_checkpoint

            resume_from = latest_checkpoint(out, warn=lambda m: is_main and print(m, file=sys.stderr))
        if cfg.init_from and resume_from is None:  # weights only; the optimiser and the EMA start afresh
            init_cfg, init_sd, info = load_init_weights(cfg.init_from,
                                                        warn=lambda m: is_main and print(m, file=sys.stderr))
            check_init_compatible(cfg.init_from, init_cfg, info, mcfg, space)
            net.load_state_dict(init_sd)
        space_params = trainable_space_params(space)
        named = list(net.named_parameters()) + list(space_params.items())
        lr = cfg.lr if cfg.lr is not None else base_lr(cfg.batch)
        optimizer = ELFOptimizer(named, lr=lr, adam_heads=cfg.adam_heads, ns_method=cfg.ns_method)
        ema = EMA(net, cfg.ema_decay)
        batches = Batches(train_set, micro * accum, seed=cfg.seed, rank=rank, world_size=world)
        total = cfg.steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * batches.per_epoch))
        warmup = cfg.warmup if cfg.warmup_frac is None else math.ceil(cfg.warmup_frac * total)
        start = 0

        if resume_from is not None:
            from elflow.checkpoint import load_checkpoint

            ckpt = resume_from
            blob = load_checkpoint(ckpt, map_location=device)
            check_compatible(blob["state"]["space_id"], space)
            net.load_state_dict({k: v for k, v in blob["model"].items() if not k.startswith("space.")})
            for k, p in space_params.items():
                p.data.copy_(blob["model"][k])
            ema.load_state_dict(blob["ema"])
            optimizer.load_state_dict(blob["optimizer"]["optimizer"])
            torch.set_rng_state(blob["optimizer"]["rng"]["torch"].cpu())
            if "cuda" in blob["optimizer"]["rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state(blob["optimizer"]["rng"]["cuda"].cpu())
            batches.load_state_dict(blob["state"]["data_position"])
            start = blob["state"]["step"]
            if is_main and not quiet:
                print(f"resuming from {ckpt} (step {start})", file=sys.stderr)
        if is_main:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(out / "run.json", {"train": cfg.to_dict(), "model": mcfg.to_dict(),
                                                 "space": space.config(), "space_id": space.space_id,
                                                 "world_size": world})

        model = MixedPass(net)  # the trained pass as a module's forward, for torch.compile and DDP
        if cfg.compile:
            model = torch.compile(model)
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # the only buffers are constant RoPE tables: no per-forward broadcast (forward counts differ by rank)
            model = DDP(model, device_ids=[local] if device.type == "cuda" else None, broadcast_buffers=False)
        params = [p for _, p in named]
        log = RunLogger(out, total, start, is_main, cfg.tensorboard, show=not quiet)
        tokens_per_step = cfg.batch * length
        totals, n_logged, t_log = {}, 0, time.perf_counter()
        last_good, step = None, start
        end = total if stop_after is None else min(total, start + stop_after)
        summary = {"start_step": start}
        for step in range(start, end):
            optimizer.set_lr(lr_at(step, lr, warmup))
            global_batch = next(batches)
            shards = [{k: (v[a * micro:(a + 1) * micro] if torch.is_tensor(v) else v)
                       for k, v in global_batch.items()} for a in range(accum)]
            m = train_step(model, space, shards, recipe, optimizer, ema, step, cfg.seed, rank * accum,
                           cfg.dtype, cfg.grad_clip, world, device, params, objective)
            nonfinite = m.pop("nonfinite", None)
            if world > 1:
                flag = torch.tensor([1.0 if nonfinite is not None else 0.0], device=device)
                dist.all_reduce(flag)
                nonfinite = flag.item() > 0 or None
            if nonfinite is not None:
                msg = (f"non-finite loss or gradient at step {step}; stopping without saving. "
                       f"The last good checkpoint is {last_good or 'none (no checkpoint was saved yet)'}; "
                       "try a lower --lr or --dtype fp32, then --resume.")
                log.write(msg)
                raise ELFError(msg)
            for k, v in m.items():
                totals[k] = totals[k] + v if k in totals else v
            n_logged += 1
            done = step + 1
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
                rec.update(step=done, lr=lr_at(step, lr, warmup), tokens_per_s=tokens_per_step * n_logged / dt,
                           elapsed=dt)
                log.log({"kind": "train", **rec})
                log.advance(n_logged, {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"})
                summary["last"] = rec
                totals, n_logged, t_log = {}, 0, time.perf_counter()
            if cfg.sample_every and done % cfg.sample_every == 0 and is_main and not quiet:
                show_samples(net, ema, space, length, cfg, log, done)
            if (done % cfg.ckpt_every == 0 or done == end) and is_main:
                last_good = save_run_checkpoint(out, done, net, space, space_params, ema, optimizer, batches,
                                                cfg, mcfg, world, cfg.keep)
                plot_losses(out)
            if world > 1 and (done % cfg.ckpt_every == 0 or done == end):
                dist.barrier()
        log.close()
        summary.update(end_step=end, out=str(out))
        return summary
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def save_run_checkpoint(out, step, net, space, space_params, ema, optimizer, batches, cfg, mcfg, world, keep):
    from elflow.checkpoint import save_checkpoint

    model_sd = dict(net.state_dict())
    model_sd.update({k: p.detach() for k, p in space_params.items()})
    ema_sd = ema.state_dict()
    state = {"format": "elflow-checkpoint-1", "train": cfg.to_dict(), "model": mcfg.to_dict(),
             "space": space.config(), "space_id": space.space_id, "data_position": batches.state_dict(),
             "world_size": world}
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return save_checkpoint(out, step, model_sd, ema_sd, {"optimizer": optimizer.state_dict(), "rng": rng},
                           state, keep=keep)


@torch.no_grad()
def show_samples(net, ema, space, length, cfg, log, step, num: int = 2):
    from elflow.flow import generate_tokens

    sampler_net = ELF(net.config).to(next(net.parameters()).device)
    ema.copy_to(sampler_net)
    sampler_net.eval()
    g = torch.Generator(device=next(net.parameters()).device).manual_seed(cfg.seed)
    tokens, _ = generate_tokens(sampler_net, num, length, cfg.sample_steps, cfg.sample_sampler,
                                omega=cfg.sample_omega, generator=g)
    for i, text in enumerate(space.decode(tokens.cpu())):
        log.write(f"[step {step}] sample {i}: {text[:300]}")


# ----------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(p) -> None:
    p.add_argument("--preset", default="demo", help=f"network size: {', '.join(PRESETS)}")
    p.add_argument("--data", default="builtin",
                   help="'builtin' (Shakespeare), a .txt file or folder, a .jsonl file, or a hub dataset name")
    p.add_argument("--field", default="text", help="the text field of .jsonl / hub records")
    p.add_argument("--on-bad", choices=["stop", "skip"], default="stop",
                   help="empty, binary or non-UTF-8 files and bad jsonl lines: stop with an error, or skip them")
    p.add_argument("--space", default=None,
                   help="embedding space: minilm (offline default), t5-small, t5:PATH, hf:PATH, "
                        "token-table:BASE, random-table:BASE, learned-table:BASE (default: minilm for tiny/demo, "
                        "t5-small otherwise)")
    p.add_argument("--latent-std", default=None, help="divide encoder outputs by this ('auto' estimates it)")
    p.add_argument("--length", type=int, default=None, help="sequence length L (default: the preset's)")
    p.add_argument("--layout", choices=["packed", "document"], default="packed")
    p.add_argument("--batch", type=int, default=32, help="global batch: rows per optimiser step, all ranks")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward (accumulation)")
    p.add_argument("--steps", type=int, default=1000, help="optimiser steps")
    p.add_argument("--epochs", type=float, default=None, help="run length in passes over the data (overrides --steps)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3 * batch / 256)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--ema-decay", type=float, default=None, help="EMA decay (default 0.9999; demo 0.995)")
    p.add_argument("--adam-heads", action="store_true",
                   help="optimise output heads and embedders with Adam instead of Muon (cheaper on CPU)")
    p.add_argument("--ns-method", choices=NS_METHODS, default="auto",
                   help="how Muon's Newton-Schulz polynomial is evaluated: iterate (torch's five steps), "
                        "spectral (the same polynomial on the Gram matrix's eigenvalues, 2-4x faster on a CPU for "
                        "large matrices) or by-shape (spectral where it pays); auto: by-shape for fp32 "
                        "Newton-Schulz on CPUs, iterate on GPUs")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="autocast precision; auto: bf16 on GPUs and CPUs with native bf16 matmuls, else fp32")
    p.add_argument("--compile", action="store_true", help="torch.compile the network")
    p.add_argument("--grad-checkpoint", action="store_true", help="activation checkpointing per block")
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="run folder (default runs/<preset>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from the weights of this run or checkpoint (its EMA; fresh optimiser, EMA and step)")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    p.add_argument("--sample-every", type=int, default=0, help="print samples every N steps (0: never)")
    p.add_argument("--decode-noise-scale", type=float, default=None, help="decode corruption scale (5; 1 for cond.)")
    p.add_argument("--tensorboard", action="store_true")
    p.add_argument("--cache-dir", default=None, help="tokenization and download cache")


def config_from_args(args) -> TrainConfig:
    model = {k: getattr(args, k) for k in ("depth", "hidden", "heads") if getattr(args, k) is not None}
    recipe = {} if args.decode_noise_scale is None else {"decode_noise_scale": args.decode_noise_scale}
    ema = args.ema_decay if args.ema_decay is not None else (0.995 if args.preset in ("tiny", "demo") else 0.9999)
    for name in ("batch", "steps", "log_every", "ckpt_every"):
        if getattr(args, name) < 1:
            raise ELFError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.epochs is not None and not args.epochs > 0:
        raise ELFError(f"--epochs must be > 0, got {args.epochs}")
    return TrainConfig(
        preset=args.preset, data=args.data, text_field=args.field, on_bad=args.on_bad,
        space=args.space or DEFAULT_SPACE.get(args.preset, "t5-small"), latent_std=args.latent_std,
        length=args.length, layout=args.layout, batch=args.batch, micro_batch=args.micro_batch, steps=args.steps,
        lr=args.lr, warmup=args.warmup, ema_decay=ema, adam_heads=args.adam_heads, ns_method=args.ns_method,
        grad_clip=args.grad_clip,
        dtype=args.dtype, compile=args.compile, grad_checkpoint=args.grad_checkpoint, seed=args.seed,
        log_every=args.log_every, ckpt_every=args.ckpt_every, keep=args.keep, sample_every=args.sample_every,
        tensorboard=args.tensorboard, recipe=recipe, model=model, epochs=args.epochs, init_from=args.init_from)


def run(args) -> int:
    cfg = config_from_args(args)
    out = args.out or f"runs/{cfg.preset}"
    summary = train(cfg, out, resume=args.resume, overwrite=args.overwrite, cache_dir=args.cache_dir)
    if summary.get("last"):
        print(f"done: step {summary['end_step']}, loss {summary['last']['loss']:.4f}; run folder {out}")
    return 0
