"""`elflow train`: the training loop, alone or under torchrun (DDP: NCCL on GPUs, Gloo on CPUs).

    train(cfg, out, ...)    check everything, hold the run folder, set up (space, data, network, optimiser),
                            restore or start from stored weights, run the steps, save; `run` is the command
    train_step(...)         one optimiser step of any method over this rank's shards

The run's description is elflow.runconfig (`TrainConfig`, importable from here too), the run folder's rules
are elflow.runfolder.

`--method` chooses what is trained (elflow.methods): ELF (the default), or a token-level baseline, an
autoregressive LM (ar) or a masked diffusion LM (mdlm). All share the data pipeline, the optimiser, the EMA,
the checkpoints, exact resume, torchrun and one step function (`train_step` over the method's
`TrainedPass`); a baseline reads the embedding space's token ids through its tokenizer alone (no encoder is
loaded) and is sized to the parameter count of the ELF network that the same flags would build (`--match`).

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
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from elflow.flow import Recipe
from elflow.methods import Method, TrainedPass, get_method
from elflow.model import get_config
from elflow.optim import EMA, ELFOptimizer, lr_at
from elflow.runconfig import RUN_PRESETS, TrainConfig, add_setting_arguments, given_settings, mutable_flags, \
    resume_conflicts, with_default
from elflow.runfolder import (DECODER_STAGE, RunFolder, RunLogger, check_run_dir, no_space, plot_losses, stored_config,
                              trim_metrics)
from elflow.utils import (ELFError, FolderLock, NoSpace, atomic_write_json, autocast, check_device, check_output,
                          device_name, fast_bf16, first_line, flushed_denormals, no_space_error, on_every_rank,
                          on_rank0, process_group, resolve_dtype, setup_distributed, use_tf32)

__all__ = ["TrainConfig", "RUN_PRESETS", "train", "train_step", "shard_generators", "add_arguments", "run",
           "config_from_args"]


# ----------------------------------------------------------------------------------------------------------
# the step


def shard_generators(seed: int, step: int, shard: int, device) -> tuple[torch.Generator, torch.Generator]:
    """(device generator, CPU generator) for one shard of one step, independent of ranks and resumes."""
    s = (seed * 1_000_003 + step) * 4099 + shard
    g = torch.Generator(device=device).manual_seed(s)
    c = torch.Generator().manual_seed(s ^ 0x5DEECE66D)
    return g, c


def unwrap(model) -> TrainedPass:
    """The TrainedPass of a pass under DDP and / or torch.compile."""
    inner = model.module if hasattr(model, "module") else model
    return getattr(inner, "_orig_mod", inner)


def train_step(model, shards: list[dict], optimizer: ELFOptimizer, ema: EMA | None, step: int, seed: int,
               first_shard: int, dtype: str = "bf16", grad_clip: float = 1.0, world_size: int = 1, device=None,
               params=None) -> dict:
    """One optimiser step over this rank's shards (gradient accumulation), for every method. `model` is a
    method's TrainedPass (under DDP or torch.compile or not). Each shard draws its randomness outside the
    pass from generators seeded by (seed, step, shard); its loss is the method's mean over the shard (ELF's:
    a token mean over the shard's scored positions), divided by the number of shards of the whole global
    batch, so that the step's loss is the mean over micro-batches and ranks. Returns the method's sums over
    the shards plus the gradient norm and "nonfinite" (1 when the loss or the gradient norm is not finite),
    all tensors: the step reads no value on the host."""
    passing = unwrap(model)
    device = device or next(passing.net.parameters()).device
    n_shards = len(shards) * world_size
    totals: dict[str, torch.Tensor] = {}
    for a, shard in enumerate(shards):
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in shard.items()}
        g, c = shard_generators(seed, step, first_shard + a, device)
        draw = passing.draw(batch, g, c)
        sync = a == len(shards) - 1 or not hasattr(model, "no_sync")
        with (nullcontext() if sync else model.no_sync()):
            with autocast(device, dtype):
                loss, sums = model(batch, draw)
            (loss / n_shards * world_size).backward()  # DDP averages over ranks: mean over all shards
        for k, v in sums.items():
            totals[k] = totals[k] + v if k in totals else v
    return finish_step(model, passing.net, totals, len(shards), optimizer, ema, grad_clip, params)


def finish_step(model, net, totals: dict, n_local: int, optimizer, ema, grad_clip: float, params=None) -> dict:
    """Clip, step, update the EMA and average: the end of every method's optimiser step. Whether the loss and
    the gradient are finite is recorded on the device ("nonfinite"), not read: the loop reads it where it
    reads the log (`train_loop`), and stops before anything of a step that was not finite is saved."""
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    totals["grad_norm"] = grad_norm.detach()
    totals["loss"] = totals["loss"] / n_local
    totals["nonfinite"] = (~(torch.isfinite(totals["grad_norm"]) & torch.isfinite(totals["loss"]))).float()
    optimizer.step()
    optimizer.zero_grad()
    if ema is not None:
        ema.update(net)
    return totals


def summarize(totals: dict, n_steps: int, method: Method) -> dict:
    """Sums over steps (and ranks) -> the numbers of one log line: the mean loss and gradient norm, and the
    method's own."""
    t = {k: v.item() if v.numel() == 1 else v.tolist() for k, v in totals.items() if k != "nonfinite"}
    rec = {"loss": t["loss"] / max(n_steps, 1), "grad_norm": t["grad_norm"] / max(n_steps, 1)}
    return {**rec, **method.summarize(t)}


# ----------------------------------------------------------------------------------------------------------
# setup, restore and save


@dataclass
class Setup:
    """The objects of one run, built and checked before anything is written."""

    cfg: TrainConfig
    method: Method
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
    net: torch.nn.Module
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


def network_overrides(cfg: TrainConfig, recipe: Recipe) -> dict:
    """The ELFConfig fields a run sets besides its preset and its space: the --depth / --hidden / --heads
    overrides and the network's variants (the run's flags over a stored config's). A network without
    self-conditioning for self_cond_prob 0; the path's constants where a v- or eps-head reads them."""
    top = {"bottleneck": cfg.bottleneck, "predict": cfg.predict, "conditioning": cfg.conditioning,
           "decoder": cfg.decoder}
    if not recipe.self_conditioned:
        top["self_cond"] = False
    if cfg.predict != "x":
        top.update(noise_scale=recipe.noise_scale, t_eps=recipe.t_eps)
    return {**cfg.model, **{k: v for k, v in top.items() if v is not None}}


def setup_run(cfg: TrainConfig, method: Method, rank: int, world: int, local: int, device, cache_dir=None,
              decoder_from=None) -> Setup:
    """Build the space, the data, the network and the optimiser: every check that needs them happens here.
    `decoder_from`: the run whose (EMA) weights are a separate decoder's."""
    from elflow.data import Batches
    from elflow.encoders import build_space, space_spec

    micro = micro_batch_for(cfg, world)
    accum = cfg.batch // (world * micro)
    torch.manual_seed(cfg.seed)
    spec = space_spec(cfg.space, cfg.latent_std, cfg.space_dim, cfg.space_seed, cfg.space_stream)
    space = build_space(method.space_spec(spec), device=device)
    length = cfg.length
    if space.max_length is not None and length > space.max_length:
        raise ELFError(f"--length {length} is longer than the encoder accepts ({space.max_length})")
    train_set = training_data(cfg, space, length, cache_dir)
    recipe = Recipe.from_dict({"decode_noise_scale": 1.0, **cfg.recipe} if cfg.source_length else cfg.recipe)
    if cfg.decoder == "separate":  # the decoder is trained (first stage) and frozen: every row denoises
        recipe = recipe.replace(decode_prob=0.0)
    try:  # the ELF network of these settings (a baseline is sized to it)
        shape = get_config(cfg.preset, dim=space.dim, vocab_size=space.vocab_size, max_length=length,
                           **network_overrides(cfg, recipe))
    except (TypeError, ValueError) as e:
        raise ELFError(f"the network settings do not fit together: {e}") from None
    net, params = method.build(cfg, shape, space, train_set, recipe, device)
    if decoder_from is not None:
        attach_decoder(net, decoder_from, space)
    # the optimiser names a trainable space's parameters "space.<name>" beside the network's
    named = list(net.named_parameters()) + [("space." + n, p) for n, p in space.named_parameters()
                                            if p.requires_grad]
    optimizer = ELFOptimizer(named, lr=cfg.lr, adam=method.adam_names(net, cfg), ns_method=cfg.ns_method,
                             kind=cfg.optimizer, weight_decay=cfg.weight_decay)
    ema = EMA(net, cfg.ema_decay)
    batches = Batches(train_set, micro * accum, seed=cfg.seed, rank=rank, world_size=world)
    steps = cfg.steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * batches.per_epoch))
    warmup = cfg.warmup if cfg.warmup_frac is None else math.ceil(cfg.warmup_frac * steps)
    return Setup(cfg, method, params, rank, world, local, device, micro, accum, length,
                 resolve_dtype(cfg.dtype, device), space, net, recipe, named, cfg.lr, optimizer, ema, batches,
                 steps, warmup)


def training_data(cfg: TrainConfig, space, length: int, cache_dir=None):
    """The training split of the run's data in `space`: (source, target) pairs or text, rows read from the
    data's token store (`elflow.ingest`: the store itself, or one prepared once into the cache)."""
    return run_data(cfg, space, length, cache_dir)[0]


def run_data(cfg: TrainConfig, space, length: int, cache_dir=None):
    """(training split, held-out split) of the run's data in `space`, as training_data reads them."""
    from elflow.ingest import build_dataset, build_pairs

    if cfg.source_length:
        return build_pairs(cfg.data, space, cfg.source_length, length, val_fraction=cfg.val_fraction,
                           seed=cfg.seed, cache_dir=cache_dir, source_field=cfg.source_field,
                           target_field=cfg.target_field, on_bad=cfg.on_bad, source_slot=cfg.source_slot)
    return build_dataset(cfg.data, space, length, layout=cfg.layout, val_fraction=cfg.val_fraction,
                         seed=cfg.seed, cache_dir=cache_dir, field=cfg.text_field, on_bad=cfg.on_bad)


def attach_decoder(net, path, space) -> None:
    """A separate decoder's weights into `net` (a SeparateDecoderELF): the EMA weights of the decode-only run
    `path`, which must hold a network of the decoder's shape and options in the same space."""
    from elflow.checkpoint import check_init_compatible, load_init_weights

    init_cfg, sd, info = load_init_weights(path)
    check_init_compatible(path, init_cfg, info, net.decoder, space)
    net.load_decoder(sd)


def decoder_stage(cfg: TrainConfig) -> TrainConfig:
    """The first stage of a --decoder separate run: the network of its shape trained in decode mode alone
    (decode_prob 1) for --decoder-steps (a quarter of --steps by default), warmed up over the same share of
    its steps; it becomes the frozen decoder of the second stage."""
    steps = cfg.decoder_steps or max(1, math.ceil(cfg.steps / 4))
    return replace(cfg, decoder="shared", decoder_steps=None, decoder_from=None, steps=steps, epochs=None,
                   warmup=math.ceil(cfg.warmup * steps / cfg.steps) if cfg.warmup_frac is None else cfg.warmup,
                   recipe={**cfg.recipe, "decode_prob": 1.0}, sample_every=0)


def start_from(run: Setup, path, quiet: bool = False) -> None:
    """Load stored weights into a fresh run (`--init-from`): its EMA starts from them; the optimiser is new."""
    from elflow.checkpoint import check_init_compatible, load_init_weights

    init_cfg, init_sd, info = load_init_weights(path, warn=lambda m: run.rank == 0 and print(m, file=sys.stderr))
    check_init_compatible(path, init_cfg, info, run.net, run.space)
    run.net.load_state_dict(init_sd)
    run.ema = EMA(run.net, run.cfg.ema_decay)
    if run.rank == 0 and not quiet:
        print(f"starting from the weights of {info['checkpoint']}", file=sys.stderr)


def resume_point(out: Path, cfg: TrainConfig) -> Path | None:
    """The checkpoint a --resume continues from, chosen before anything is built or read: the newest that
    passes verification (with its optimiser state), whose stored run is the one of run.json. None for a run
    that saved none yet; ELFError when it saved some and none can be resumed, or for a checkpoint of another run
    than run.json describes (an edited run.json)."""
    from elflow.checkpoint import list_checkpoints, newest_usable, read_state
    from elflow.runfolder import read_train_config

    ckpt, bad = newest_usable(out, need_optimizer=True)
    if ckpt is None:
        if list_checkpoints(out):
            raise ELFError(f"{out}: no checkpoint can be resumed ({'; '.join(bad)}); nothing was changed. Restore "
                           "the files, or start the run again with --overwrite")
        return None
    for why in bad:
        print(f"warning: skipping a bad checkpoint: {why}", file=sys.stderr)
    stored = read_train_config(read_state(ckpt).get("train", {}), ckpt / "state.json")
    diff = resume_conflicts(stored, cfg)
    if diff:
        raise ELFError(f"{out / 'run.json'} describes another run than its checkpoint {ckpt.name} "
                       f"({'; '.join(diff)}); run.json was edited or replaced: restore it")
    return ckpt


def restore(run: Setup, ckpt: Path | None, quiet: bool = False) -> int:
    """Load the checkpoint `ckpt` (rank 0's choice, `claim_run` / `resume_point`) into the run; returns its step
    (0 for none)."""
    from safetensors.torch import load_file

    from elflow.checkpoint import load_checkpoint, split_space_state
    from elflow.encoders import check_compatible

    if ckpt is None:
        return 0
    blob = load_checkpoint(ckpt, map_location=run.device)
    check_compatible(blob["state"]["space_id"], run.space)
    net_sd, space_sd = split_space_state(blob["model"])  # checkpoints that keep the space in model.safetensors
    if (ckpt / "space.safetensors").exists():
        space_sd = load_file(ckpt / "space.safetensors", device=str(run.device))
    try:
        run.net.load_state_dict(net_sd)
        if space_sd or run.space.trainable:
            run.space.load_trainable_state_dict(space_sd)
        run.ema.load_state_dict(blob["ema"])
        run.optimizer.load_state_dict(blob["optimizer"]["optimizer"])
        torch.set_rng_state(blob["optimizer"]["rng"]["torch"].cpu())
        if "cuda" in blob["optimizer"]["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(blob["optimizer"]["rng"]["cuda"].cpu())
        run.batches.load_state_dict(blob["state"]["data_position"])
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise ELFError(f"{ckpt}: does not fit this run ({first_line(e)}); it holds another network or state "
                       "than run.json describes") from None
    start = blob["state"]["step"]
    if run.rank == 0 and not quiet:
        print(f"resuming from {ckpt} (step {start})", file=sys.stderr)
    return start


def save_run_checkpoint(out: Path, step: int, run: Setup, data_position: dict | None = None) -> Path:
    """The checkpoint of `step`; `data_position` is the data iterator's state after that step's batch (its
    own state by default; a prefetching loop has read ahead)."""
    from elflow.checkpoint import save_checkpoint

    cfg = run.cfg
    position = data_position if data_position is not None else run.batches.state_dict()
    state = {"format": "elflow-checkpoint-1", "method": run.method.name, "params": run.params,
             "train": cfg.to_dict(), **run.method.describe(run.net),
             "space": run.space.config(), "space_id": run.space.space_id, "data_position": position,
             "world_size": run.world, "settings": model_settings(run)}
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return save_checkpoint(out, step, run.net.state_dict(), run.ema.state_dict(),
                           {"optimizer": run.optimizer.state_dict(), "rng": rng}, state, keep=cfg.keep,
                           space_sd=run.space.trainable_state_dict())


def model_settings(run: Setup) -> dict:
    """What a user of the model needs to know without flags: its length; for a conditional model its source
    length and task; for a distilled one its step count; and the sampling defaults of its kind
    (generate.SAMPLING_DEFAULTS)."""
    from elflow.generate import SAMPLING_DEFAULTS, distilled_defaults

    cfg = run.cfg
    out, sampling = {"length": run.length}, {}
    if cfg.source_length:
        out.update(source_length=cfg.source_length, source_slot=cfg.source_slot,
                   **({"task": cfg.task} if cfg.task else {}))
        sampling = SAMPLING_DEFAULTS["conditional"]
    if cfg.distillation:
        out.update(distilled_steps=cfg.distillation["student_steps"], teacher_steps=cfg.distillation["teacher_steps"])
        sampling = {**sampling, **distilled_defaults(cfg.distillation["student_steps"])}
    if not run.recipe.self_conditioned:  # no self-conditioning, nothing for omega to guide by
        sampling = {**sampling, "omega": 1.0}
    return {**out, **({"sampling": dict(sampling)} if sampling else {})}


# ----------------------------------------------------------------------------------------------------------
# the loop


class Prefetch:
    """The next batches, cut into shards, read by a background thread while the current step runs: each
    item is (shards, the data position after its batch). On a GPU the shards are in pinned memory, so that
    the step's copies to the device do not wait for the host. Reads exactly `count` batches."""

    def __init__(self, batches, count: int, micro: int, accum: int, pin: bool, depth: int = 2):
        import queue
        import threading

        self.batches, self.count, self.micro, self.accum, self.pin = batches, count, micro, accum, pin
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._work, name="elflow-prefetch", daemon=True)
        self.thread.start()

    def _shards(self, batch: dict) -> list[dict]:
        m = self.micro
        shards = [{k: (v[a * m:(a + 1) * m] if torch.is_tensor(v) else v) for k, v in batch.items()}
                  for a in range(self.accum)]
        if self.pin:
            shards = [{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in sh.items()} for sh in shards]
        return shards

    def _work(self) -> None:
        import queue

        for _ in range(self.count):
            try:
                item = (self._shards(next(self.batches)), self.batches.state_dict())
            except BaseException as e:  # noqa: BLE001  (raised in the loop's thread by __next__)
                item = e
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self.stop.is_set() or isinstance(item, BaseException):
                return

    def __next__(self):
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _reduce(totals: dict, world: int) -> dict:
    """Sums over ranks of the log's tensors in one all_reduce; the loss and gradient norm averaged."""
    keys = sorted(totals)
    flat = torch.cat([totals[k].reshape(-1).float() for k in keys])
    dist.all_reduce(flat)
    parts = flat.split([totals[k].numel() for k in keys])
    return {k: p.reshape(totals[k].shape) / (world if k in ("loss", "grad_norm") else 1) for k, p in zip(keys, parts)}


def train_loop(run: Setup, out: Path, start: int, quiet: bool = False, stop_after: int | None = None,
               on_checkpoint=None, time_limit: float | None = None, tracker=None) -> dict:
    """Steps start .. end of the schedule; rank 0 logs and saves. `on_checkpoint(path)` follows each save.
    `time_limit` (seconds): end (with a checkpoint) after the first step that finishes past it (under
    several ranks, the first logging step past it). `tracker`: rank 0's W&B run (elflow.tracking.Tracker),
    finished when the loop ends.

    A step reads nothing on the host. The loop reads the device's numbers where it must: on logging steps
    (the log's sums, reduced over ranks in one all_reduce, and with them whether any step since the last
    reading was not finite), and before a checkpoint or samples; a step that was not finite stops the run
    there, before anything of it is saved."""
    cfg, world, rank, device, micro = run.cfg, run.world, run.rank, run.device, run.micro
    is_main = rank == 0
    # the trained pass as a module's forward (the space's encode inside it), for torch.compile and DDP
    model = TrainedPass(run.method, run.net, run.space, run.recipe)
    if cfg.compile:
        model = torch.compile(model)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # the batch is on the device already and the draw's discrete choices stay on the CPU: no device_ids,
        # so DDP moves no input; the only buffers are constant (RoPE tables, a frozen encoder's): no
        # per-forward broadcast (forward counts differ by rank)
        model = DDP(model, device_ids=None, broadcast_buffers=False)
    params = [p for _, p in run.named]
    log = RunLogger(out, run.steps, start, is_main, cfg.tensorboard, show=not quiet, tracker=tracker)
    tokens_per_step = cfg.batch * run.length
    totals, n_logged, t_log = {}, 0, time.perf_counter()
    last_good, checked = None, start  # the last checkpoint written; the last step known to be finite
    end = run.steps if stop_after is None else min(run.steps, start + stop_after)
    summary = {"start_step": start}
    t_start = time.perf_counter()
    ok = False
    batches = Prefetch(run.batches, end - start, micro, run.accum, pin=device.type == "cuda")

    def stop_if_nonfinite(nonfinite, done):
        nonlocal checked
        if nonfinite is not None and nonfinite.item():
            what = f"at step {done}" if done == checked + 1 else f"in steps {checked + 1}..{done}"
            raise ELFError(f"non-finite loss or gradient {what}; stopping without saving. The last good "
                           f"checkpoint is {last_good or 'none (no checkpoint was saved yet)'}; try a lower --lr "
                           "or --dtype fp32, then --resume.")
        checked = done

    try:
        for step in range(start, end):
            run.optimizer.set_lr(run.lr_at(step))
            shards, position = next(batches)
            m = train_step(model, shards, run.optimizer, run.ema, step, cfg.seed, rank * run.accum, run.dtype,
                           cfg.grad_clip, world, device, params)
            for k, v in m.items():
                totals[k] = totals[k] + v if k in totals else v
            n_logged += 1
            done = step + 1
            logging = done % cfg.log_every == 0 or done == end
            if time_limit is not None and done < end and (world == 1 or logging):
                over = time.perf_counter() - t_start >= time_limit
                if world > 1:  # every rank stops at the same step
                    flag = torch.tensor([float(over)], device=device)
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    over = bool(flag.item())
                if over:
                    end, logging = done, True
            saving = done % cfg.ckpt_every == 0 or done == end
            sampling = bool(cfg.sample_every) and done % cfg.sample_every == 0 and log.wants_samples
            if logging:
                if world > 1:
                    totals = _reduce(totals, world)
                stop_if_nonfinite(totals.pop("nonfinite"), done)
                rec = summarize(totals, n_logged, run.method)
                dt = time.perf_counter() - t_log
                rec.update(step=done, lr=run.lr_at(step),
                           tokens_per_s=tokens_per_step * n_logged / dt, elapsed=dt)
                log.log({"kind": "train", **rec})
                log.advance(n_logged, {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"})
                summary["last"] = rec
                totals, n_logged, t_log = {}, 0, time.perf_counter()
            elif saving or sampling and world == 1:  # read before anything of these steps leaves the loop
                bad = totals["nonfinite"].clone()
                if world > 1:
                    dist.all_reduce(bad)
                stop_if_nonfinite(bad, done)
            if sampling:
                show_samples(run, log, done)
            if saving and is_main:
                last_good = save_run_checkpoint(out, done, run, position)
                if on_checkpoint is not None:
                    on_checkpoint(last_good)
                plot_losses(out)
            if world > 1 and saving:
                dist.barrier()
            if done == end:
                break
        ok = True
    except (OSError, NoSpace) as e:
        if no_space_error(e):
            raise no_space(e, out) from None
        raise
    finally:
        batches.close()
        log.close(ok)
    summary.update(end_step=end, out=str(out))
    return summary


def micro_batch_for(cfg: TrainConfig, world: int, stored: dict | None = None) -> int:
    """The rows per forward/backward of `cfg` on `world` ranks: --micro-batch, else the stored run's (on
    --resume: a run's first start resolves it to batch / its ranks; `stored` is its run.json), else batch /
    ranks. A batch it does not split over the ranks is a one-line ELFError that says what to give."""
    kept = (stored or {}).get("train", {}).get("micro_batch")
    if cfg.micro_batch or kept:
        micro = cfg.micro_batch or kept
    elif stored and stored.get("world_size"):  # a stored run without a micro-batch: its first start's
        micro = max(1, cfg.batch // int(stored["world_size"]))
    else:
        micro = max(1, cfg.batch // world)
    if cfg.batch % (world * micro) == 0:
        return micro
    shards = cfg.batch // micro
    if stored is None or cfg.batch % micro:
        raise ELFError(f"--batch {cfg.batch} is not divisible by world size {world} x --micro-batch {micro}; "
                       f"choose a batch that is a multiple of {world * micro}")
    ranks = [str(r) for r in range(1, shards + 1) if shards % r == 0]
    smaller = [m for m in range(micro - 1, 0, -1) if cfg.batch % (world * m) == 0]
    other = (f", or give --micro-batch {smaller[0]} to continue with that micro-batch (the rest of the run then "
             "draws other noise than an uninterrupted run)" if smaller else "")
    raise ELFError(f"the run's --batch {cfg.batch} in micro-batches of {micro} rows does not split over {world} "
                   f"ranks: resume it on {' or '.join(ranks)} rank{'s' if ranks != ['1'] else ''} to continue "
                   f"exactly{other}")


SHARED_FOLDER_WAIT = 5.0  # seconds a rank looks for rank 0's lock (a network filesystem's caches lag)


def shared_folder_check(out: Path, lock_text: str, host0: str) -> None:
    """ELFError unless this rank sees the lock rank 0 took in `out` (its text, broadcast): a run folder on
    several nodes must be one folder that every node sees."""
    deadline = time.monotonic() + SHARED_FOLDER_WAIT
    while True:
        try:
            seen = (out / FolderLock.NAME).read_text()
        except OSError:
            seen = None
        if seen == lock_text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if seen != lock_text:
        raise ELFError(f"--out {out} is not shared between the nodes: this node does not see the lock that rank 0 "
                       f"(host {host0}) holds in it ({(out / FolderLock.NAME).absolute()} is "
                       f"{'missing' if seen is None else 'another'} here). A run on several nodes needs a run "
                       "folder on a filesystem that every node mounts at the same path (NFS, Lustre, GPFS, ...)")


def claim_run(folder: RunFolder, cfg: TrainConfig, world: int, resume: bool, overwrite: bool, device=None) -> dict:
    """Rank 0's decisions about the run folder, which every rank follows: hold it (lock, clean-up), check
    what --resume / --overwrite may do with it (a stored dtype "auto" read as what it picks on `device`),
    resolve the micro-batch (the stored run's on --resume) and choose the checkpoint to resume from. Returns
    them with the lock's text (for `shared_folder_check`)."""
    import socket

    out = folder.out
    check_output(out, folder=True)
    folder.open()
    check_run_dir(out, cfg, resume, overwrite, device)
    stored = None
    if resume and (out / "run.json").exists():
        from elflow.utils import read_json

        stored = read_json(out / "run.json")
    micro = micro_batch_for(cfg, world, stored)
    before = (stored or {}).get("train", {}).get("micro_batch")
    if before and before != micro:
        print(f"warning: continuing with --micro-batch {micro} instead of the run's {before}: from here on the "
              "run draws other noise than an uninterrupted run would", file=sys.stderr)
    ckpt = resume_point(out, cfg) if resume else None
    if resume:
        check_steps_left(out, ckpt, cfg)
    check_writable(out)
    return {"micro_batch": micro, "checkpoint": None if ckpt is None else ckpt.name,
            "lock": (out / FolderLock.NAME).read_text(), "host": socket.gethostname()}


def train(cfg: TrainConfig, out: str | os.PathLike, resume: bool = False, overwrite: bool = False,
          cache_dir=None, quiet: bool = False, stop_after: int | None = None, device: str | None = None,
          command: str = "elflow train", objective=None, time_limit: float | None = None,
          stage_of: TrainConfig | None = None) -> dict:
    """Train; returns a summary dict (rank 0). `stop_after` ends the process's work after that many steps
    of this invocation (for tests and time-boxed runs) while keeping the schedule of `cfg.steps`.

    Everything is checked before the run folder changes; --overwrite sets the old run aside and drops it
    only once the new run's first checkpoint is written (it comes back if the new run fails before).
    Under torchrun rank 0 decides about the run folder (`claim_run`: the checks, the micro-batch, the
    checkpoint to resume from) and every rank checks that it sees the same folder (`shared_folder_check`).
    `objective` (an elflow.methods.elf.Objective) replaces ELF's own (distillation); `cfg.init_from` starts a
    fresh run from stored weights.
    `time_limit` (seconds) ends this invocation after the first step past it (a wall-clock budget).

    A --decoder separate run without --decoder-from first trains its decoder (`decoder_stage`) into
    OUT/decoder, or continues it there, then the denoiser against it; both stages are stored as one model.
    `stage_of`: the settings of the run whose first stage this is, stored with the stage (what --resume reads
    while the run is in that stage).

    Training runs with CPU denormals flushed to zero (`flushed_denormals`), which leaves every kept value
    as it is and keeps a CPU step at full speed."""
    with flushed_denormals():
        return _train(cfg, out, resume, overwrite, cache_dir, quiet, stop_after, device, command, objective,
                      time_limit, stage_of)


def _train(cfg: TrainConfig, out: str | os.PathLike, resume: bool = False, overwrite: bool = False,
           cache_dir=None, quiet: bool = False, stop_after: int | None = None, device: str | None = None,
           command: str = "elflow train", objective=None, time_limit: float | None = None,
           stage_of: TrainConfig | None = None) -> dict:
    """`train`'s body (see there)."""
    out = Path(out)
    cfg = cfg.resolved()
    cfg.validate()
    if cfg.wandb:
        from elflow.tracking import require

        require()
    device = check_device(device)
    method = get_method(cfg.method)
    if objective is not None:
        method = method.with_objective(objective)
    decoder_from = None
    if cfg.decoder == "separate" and not cfg.init_from:  # (a run started from weights has its decoder in them)
        decoder_from = Path(cfg.decoder_from) if cfg.decoder_from else out / DECODER_STAGE
        if not cfg.decoder_from:
            check_run_dir(out, cfg, resume, overwrite)  # before the first stage writes anything
            began = time.perf_counter()
            stage = train(decoder_stage(cfg), decoder_from, resume=(decoder_from / "run.json").exists() and not overwrite,
                          overwrite=overwrite, cache_dir=cache_dir, quiet=quiet, stop_after=stop_after,
                          device=device, command=f"{command} (decoder stage)", time_limit=time_limit, stage_of=cfg)
            if stage["end_step"] < decoder_stage(cfg).steps:  # stopped inside the first stage
                return stage
            resume = resume or not overwrite  # the second stage starts, or continues, in a folder it already owns
            if time_limit is not None:  # one wall-clock budget for both stages
                time_limit -= time.perf_counter() - began
                if time_limit <= 0:
                    return stage
            if stop_after is not None:
                stop_after -= stage["end_step"] - stage["start_step"]
                if stop_after <= 0:
                    return stage
    owns_group = not dist.is_initialized()
    rank, world, local, dev = setup_distributed(device, cfg.dist_timeout)
    use_tf32(dev, cfg.tf32)
    cfg = cfg.resolved(dev)  # dtype "auto" -> what it picks on this device, stored so
    folder = RunFolder(out, command)
    ok = False
    try:
        claim = on_rank0(lambda: claim_run(folder, cfg, world, resume, overwrite, dev), rank, world)
        if world > 1:
            on_every_rank(lambda: shared_folder_check(out, claim["lock"], claim["host"]), rank, world)
        cfg = replace(cfg, micro_batch=claim["micro_batch"])
        if rank == 0 and cfg.epochs is None and cfg.warmup_frac is None and cfg.steps < cfg.warmup:
            print(f"warning: --steps {cfg.steps} is shorter than --warmup {cfg.warmup}: the learning rate stops at "
                  f"{lr_at(cfg.steps - 1, cfg.lr, cfg.warmup):.3g}, never reaching {cfg.lr:.3g}", file=sys.stderr)
        run = setup_run(cfg, method, rank, world, local, dev, cache_dir, decoder_from)
        if not resume and cfg.init_from:  # read before a replaced run is set aside (it may be the one in --out)
            start_from(run, cfg.init_from, quiet)
        if overwrite and (out / "run.json").exists():
            on_rank0(folder.set_aside, rank, world)
        ckpt = out / "checkpoints" / claim["checkpoint"] if claim["checkpoint"] else None
        start = restore(run, ckpt, quiet)
        if resume and start == 0 and cfg.init_from:
            start_from(run, cfg.init_from, quiet)
        if resume and rank == 0:
            trim_metrics(out, start)
        if rank == 0 and not quiet:
            print(describe_start(run), file=sys.stderr)
        tracker = [None]
        if cfg.wandb:  # started before the run folder is written: a refused start leaves no run behind
            from elflow.tracking import Tracker

            def start_tracker():
                tracker[0] = Tracker.start(cfg.wandb, cfg.wandb_run, out, tracked_settings(run), job_type="train",
                                           keep_id=True, quiet=quiet)

            on_rank0(start_tracker, rank, world)

        def write_meta():
            atomic_write_json(out / "run.json", {"train": cfg.to_dict(), "method": run.method.name,
                                                 **run.method.describe(run.net), "params": run.params,
                                                 "space": run.space.config(), "space_id": run.space.space_id,
                                                 "world_size": world,
                                                 **({"stage_of": stage_of.to_dict()} if stage_of else {})})

        try:
            on_rank0(write_meta, rank, world)
        except BaseException as e:
            if tracker[0] is not None:
                tracker[0].finish(ok=False)
            if isinstance(e, (OSError, NoSpace)) and no_space_error(e):
                raise no_space(e, out) from None
            raise
        summary = train_loop(run, out, start, quiet, stop_after, on_checkpoint=lambda _: folder.commit(),
                             time_limit=time_limit, tracker=tracker[0])
        ok = True
        return summary
    finally:
        if rank == 0:
            folder.close(ok)
        if world > 1 and dist.is_initialized() and owns_group:
            dist.destroy_process_group()


def check_steps_left(out: Path, ckpt: Path | None, cfg: TrainConfig) -> None:
    """A --resume whose --steps the run has already passed changes nothing: ELFError saying so."""
    from elflow.checkpoint import read_state

    if ckpt is None or cfg.epochs is not None:
        return
    step = read_state(ckpt)["step"]
    if step > cfg.steps:
        raise ELFError(f"{out} is already at step {step}, past --steps {cfg.steps}; nothing was changed. Pass a "
                       f"--steps above {step} to train further")


def check_writable(out: Path) -> None:
    """The run folder and its checkpoints/ take new files (an immutable or read-only checkpoints/ is found
    before any step is trained)."""
    from elflow.utils import _probe_writable

    for folder in (out, out / "checkpoints"):
        if folder.is_dir():
            try:
                _probe_writable(folder)
            except OSError as e:
                raise ELFError(f"{folder}: cannot write in it ({e.strerror or e}); nothing was trained. Make it "
                               "writable, then run again") from None


def show_samples(run: Setup, log, step, num: int = 2):
    log.samples(step, run.method.preview(run.net, run.ema, run.space, num, run.length, run.cfg))


def tracked_settings(run: Setup) -> dict:
    """What a W&B run records as its config: the run's settings and how this process runs them."""
    return {**run.cfg.to_dict(), "method": run.method.name, "params": run.params, "world_size": run.world,
            "device": str(run.device), "micro_batch": run.micro, "accumulation": run.accum,
            "schedule_steps": run.steps, "warmup_steps": run.warmup}


def describe_start(run: Setup) -> str:
    """One line on what runs where: the method and its size, the device and the precision (and why)."""
    why = ""
    if run.device.type == "cpu":
        why = (" (this CPU has native bf16 matmuls; --dtype fp32 for full precision)" if run.dtype == "bf16"
               else " (this CPU has no native bf16 matmuls)" if not fast_bf16(run.device) else "")
    ranks = f" x {run.world} ranks" if run.world > 1 else ""
    return (f"training {run.method.title} ({run.params['model']:,} parameters) on {device_name(run.device)}{ranks}, "
            f"precision {run.dtype}{why}")


# ----------------------------------------------------------------------------------------------------------
# CLI: one flag per TrainConfig field, plus the flags that say where and how to run


def add_arguments(p) -> None:
    """The run settings' flags (runconfig), then where and how to run; every flag defaults to "not given"."""
    add_setting_arguments(p)
    g = p.add_argument_group("where and how to run")
    S = argparse.SUPPRESS
    g.add_argument("--out", default=S, help=with_default("run folder", "runs/<preset>"))
    g.add_argument("--resume", action="store_true", default=S,
                   help="continue the run in --out from its last good checkpoint, with its stored settings; flags "
                        f"may change only {mutable_flags()}")
    g.add_argument("--overwrite", action="store_true", default=S,
                   help="replace the run in --out; the old run is kept until the new run's first checkpoint is "
                        "written, and other files in the folder are left alone")
    g.add_argument("--device", default=S, help=with_default("cpu or cuda; under torchrun each rank takes its GPU",
                                                            "cuda when available"))
    g.add_argument("--cache-dir", default=S, help=with_default("tokenization and download cache",
                                                               "$ELFLOW_CACHE or ~/.cache/elflow"))
    g.add_argument("--quiet", action="store_true", default=S, help="no progress bar, samples or resume notes")
    g.add_argument("--print-config", action="store_true", default=S,
                   help="print the resolved settings as JSON and exit without training")


def config_from_args(args) -> TrainConfig:
    """The run's settings: the stored ones on --resume (with the changes the command line may make), else the
    command line over the defaults (or over --defaults NAME); resolved and checked."""
    defaults = getattr(args, "defaults", None)
    given = given_settings(args, RUN_PRESETS[defaults][0] if defaults in RUN_PRESETS else None)
    if getattr(args, "resume", False):
        if hasattr(args, "defaults"):
            raise ELFError("--defaults does not go with --resume: a resumed run keeps its stored settings")
        out = args.out if hasattr(args, "out") else f"runs/{given.get('preset', TrainConfig.preset)}"
        stored = stored_config(check_output(out, folder=True))
        merged = {**stored.to_dict()}
        for k, v in given.items():
            merged[k] = {**merged[k], **v} if isinstance(v, dict) else v
        cfg = TrainConfig(**merged).resolved()
        diff = resume_conflicts(stored, cfg, run_device(getattr(args, "device", None)))
        if diff:
            raise ELFError(f"on --resume only {mutable_flags()} may change; "
                           f"the command line changes {'; '.join(diff)}. Drop those flags, or start a new run in "
                           "another --out")
    else:
        cfg = TrainConfig.named(defaults, **given).resolved()
    cfg.validate()
    return cfg.resolved(run_device(getattr(args, "device", None)))


def run_device(device: str | None):
    """The device this process trains on: --device, else its rank's GPU under torchrun, else the default."""
    device = check_device(device)
    if device is None and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(device or "cpu")


def _group_timeout(args) -> float | None:
    """The process group's timeout for `elflow train`: --dist-timeout, else the stored run's on --resume (when
    this rank can read it), else the default."""
    if hasattr(args, "dist_timeout"):
        return args.dist_timeout
    if getattr(args, "resume", False):
        out = Path(getattr(args, "out", None) or f"runs/{getattr(args, 'preset', TrainConfig.preset)}")
        try:
            return float(json.loads((out / "run.json").read_text())["train"]["dist_timeout"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return None


def run(args) -> int:
    # first the group, so that rank 0 alone reads a stored run and every rank hears what it found
    with process_group(check_device(getattr(args, "device", None)), _group_timeout(args)) as (rank, world, _):
        cfg = on_rank0(lambda: config_from_args(args), rank, world)
        if getattr(args, "print_config", False):
            if rank == 0:
                print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        out = args.out if hasattr(args, "out") else f"runs/{cfg.preset}"
        check_output(out, folder=True)  # an empty --out is an error, not the current folder
        command = "elflow train " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["train"] else "elflow train"
        summary = train(cfg, out, resume=getattr(args, "resume", False), overwrite=getattr(args, "overwrite", False),
                        cache_dir=getattr(args, "cache_dir", None), quiet=getattr(args, "quiet", False),
                        device=getattr(args, "device", None), command=command)
    if summary.get("last") and rank == 0:
        print(f"done: step {summary['end_step']}, loss {summary['last']['loss']:.4f}; run folder {out}")
    return 0
