"""`elflow train`'s library: one run's setup, its training loop and its checkpoints, alone or under torchrun.

    train(cfg, out)      check everything, hold the run folder, set up, restore or start, run the steps, save
    train_step(...)      one optimiser step of any method (elflow.methods) over this rank's shards

A global batch of `cfg.batch` rows is cut into shards of `micro_batch` rows: rank r runs shards r*A .. r*A+A-1
(A accumulation steps). Each shard draws its noise from generators seeded by (seed, step, shard), so a run's
numbers depend on the global batch alone, and a resume needs no generator state to continue exactly. Rank 0
decides about the run folder (elflow.lifecycle.claim) and alone logs and saves.
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from elflow.config import TrainConfig
from elflow.data.batches import Batches, Prefetch
from elflow.data.corpus import calibration_for
from elflow.data.datasets import check_recorded_store, check_same_store, run_data, store_record
from elflow.flow import Recipe
from elflow.lifecycle.claim import (
    RunFolder,
    absolute_paths,
    check_run_dir,
    claim_run,
    micro_batch_for,
    no_space,
    shared_folder_check,
    stored_files,
)
from elflow.lifecycle.stages import DECODER_STAGE, attach_decoder, decoder_stage
from elflow.methods import Method, TrainedPass, get_method
from elflow.model import ShortRunOptions, get_config
from elflow.optim import EMA, ELFOptimizer, check_optimizer_state
from elflow.runs.checkpoint import load_checkpoint, save_checkpoint
from elflow.runs.folder import CHECKPOINTS, OPTIMIZER_STATE, RUN_FILE, STATE_FILE, checkpoint_dir, run_files
from elflow.runs.load import check_init_compatible, checkpoint_record, load_init_weights
from elflow.runs.log import RunLogger, describe_start, plot_losses, tracked_settings, trim_metrics
from elflow.runs.record import ParamCounts, RunRecord, differences
from elflow.runs.stored import checkpoint_state, write_run
from elflow.runs.tracking import Tracker, require_wandb
from elflow.schedule import lr_at
from elflow.space import SpaceSpec, build_space, check_compatible
from elflow.util.budget import check_previews, check_training
from elflow.util.devices import (
    autocast,
    check_device,
    flushed_denormals,
    resolve_dtype,
    use_tf32,
)
from elflow.util.distributed import destroy_group, on_every_rank, on_rank0, raise_if_peer_lost, setup_distributed
from elflow.util.errors import ELFError, first_line
from elflow.util.files import NoSpace, disk_full

__all__ = ["TrainConfig", "train", "train_step", "shard_generators"]


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
# one run's objects


@dataclass
class Setup:
    """The objects of one run, built and checked before anything is written."""

    cfg: TrainConfig
    method: Method
    params: dict  # {"model": its count, "elf": the ELF network's count it is matched to, "match"}
    rank: int
    world: int
    device: torch.device
    micro: int
    accum: int
    length: int
    dtype: str  # "bf16" or "fp32" (cfg.dtype resolved for the device)
    space: object
    net: torch.nn.Module
    recipe: Recipe
    named: list
    optimizer: ELFOptimizer
    ema: EMA
    batches: Batches
    steps: int  # the schedule's length (cfg.steps, or cfg.epochs passes over the data)
    warmup: int
    record: RunRecord | None = None  # the run's description (`run_record`), made once set-up is done

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.cfg.lr, self.warmup, self.cfg.lr_decay, self.steps, self.cfg.lr_schedule)


def set_up(cfg: TrainConfig, method: Method, rank: int, world: int, device, cache_dir=None,
           decoder_from=None) -> Setup:
    """Build the space, the data, the network and the optimiser: every check that needs them happens here.
    `decoder_from`: the run whose (EMA) weights are a separate decoder's."""
    micro = micro_batch_for(cfg, world)
    accum = cfg.batch // (world * micro)
    torch.manual_seed(cfg.seed)
    spec = cfg.space.build_spec()
    space = build_space(method.space_spec(spec), device=device, calibration=calibration_for(spec))
    length = cfg.length
    if space.max_length is not None and length > space.max_length:
        raise ELFError(f"--length {length} is longer than the encoder accepts ({space.max_length})")
    train_set = run_data(cfg, space, length, cache_dir)[0]
    recipe = cfg.flow_recipe()
    if cfg.separate_decoder:  # the decoder is trained (first stage) and frozen: every row denoises
        recipe = recipe.replace(decode_prob=0.0)
    try:  # the ELF network of these settings (a baseline is sized to it)
        shape = get_config(cfg.preset, dim=space.dim, vocab_size=space.vocab_size, max_length=length,
                           **cfg.network_fields(recipe))
    except (TypeError, ValueError) as e:
        raise ELFError(f"the network settings do not fit together: {e}") from None
    check_training(cfg, shape, space, recipe, method, micro, device)  # before the network
    net, params = method.build(cfg, shape, space, train_set, recipe, device)
    if decoder_from is not None:
        attach_decoder(net, decoder_from, space)
    # the optimiser names a trainable space's parameters "space.<name>" beside the network's
    named = list(net.named_parameters()) + [("space." + n, p) for n, p in space.named_parameters()
                                            if p.requires_grad]
    optimizer = ELFOptimizer(named, lr=cfg.lr, adam=method.adam_names(net, cfg), ns_method=cfg.ns_method,
                             kind=cfg.optimizer, weight_decay=cfg.weight_decay, update_rule=cfg.update_rule)
    ema = EMA(net, cfg.ema_decay)
    batches = Batches(train_set, micro * accum, seed=cfg.seed, rank=rank, world_size=world)
    steps = cfg.steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * batches.per_epoch))
    warmup = cfg.warmup if cfg.warmup_frac is None else math.ceil(cfg.warmup_frac * steps)
    setup = Setup(cfg, method, params, rank, world, device, micro, accum, length, resolve_dtype(cfg.dtype, device),
                  space, net, recipe, named, optimizer, ema, batches, steps, warmup)
    setup.record = run_record(setup)
    # (an autoregressive sampler takes one pass per position)
    check_previews(steps, cfg.sample_every, getattr(setup.record.sampling, "steps", None) or length)
    return setup


def start_from(setup: Setup, path, quiet: bool = False, read: tuple | None = None) -> None:
    """Load stored weights into a fresh run (`--init-from`): its EMA starts from them; the optimiser is new.
    `read`: (record, weights, origin) of `path` as the caller has read them already (a distillation's teacher),
    so that they are not read again."""
    record, init_sd, origin = read or load_init_weights(path, warn=lambda m: setup.rank == 0 and print(m, file=sys.stderr))
    check_init_compatible(path, record, setup.net, setup.space)
    new = set(setup.net.state_dict()) - set(init_sd)
    if new and all(k.startswith("target_embed.") for k in new):  # a flow map from its teacher: the new input stays 0
        setup.net.load_state_dict(init_sd, strict=False)
    else:
        setup.net.load_state_dict(init_sd)
    setup.ema = EMA(setup.net, setup.cfg.ema_decay)
    if setup.rank == 0 and not quiet:
        print(f"starting from the weights of {origin.path}", file=sys.stderr)


def restore(setup: Setup, ckpt: Path | None, state: dict | None = None, quiet: bool = False) -> int:
    """Load the checkpoint `ckpt` (rank 0's choice, `claim_run`, with the state.json it read: `state`) into the
    run, each file read once and checked on the bytes read; returns its step (0 for none)."""
    if ckpt is None:
        return 0
    try:
        blob = load_checkpoint(ckpt, map_location=setup.device, state=state)
    except ELFError as e:
        raise ELFError(f"{e}; nothing was changed: restore the file, or move {ckpt.name} out of {ckpt.parent} to "
                       "resume from the checkpoint before it") from None
    check_same_store(blob["state"].get("data_store"), setup.batches.dataset, ckpt / STATE_FILE)
    stored = checkpoint_record(ckpt, blob["state"])
    check_same_model(setup.record, stored, ckpt)
    if stored.space.id:
        check_compatible(stored.space.id, setup.space)
    try:
        setup.net.load_state_dict(blob["model"])
        if blob["space"] or setup.space.trainable:
            setup.space.load_trainable_state_dict(blob["space"])
        setup.ema.load_state_dict(blob["ema"])
        check_optimizer_state(setup.optimizer, blob["optimizer"]["optimizer"], setup.named, ckpt / OPTIMIZER_STATE,
                              blob["state"]["step"])
        setup.optimizer.load_state_dict(blob["optimizer"]["optimizer"])
        torch.set_rng_state(blob["optimizer"]["rng"]["torch"].cpu())
        if "cuda" in blob["optimizer"]["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(blob["optimizer"]["rng"]["cuda"].cpu())
        setup.batches.load_state_dict(blob["state"]["data_position"])
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise ELFError(f"{ckpt}: does not fit this run ({first_line(e)}); it holds another network or state "
                       "than run.json describes") from None
    start = blob["state"]["step"]
    if setup.rank == 0 and not quiet:
        print(f"resuming from {ckpt} (step {start})", file=sys.stderr)
    return start


def check_same_model(made: RunRecord, stored: RunRecord, ckpt: Path) -> None:
    """The model a resumed run's settings (run.json's "train") make is the one its checkpoint holds (their
    `RunRecord.identity`; a space stored without an id is not compared): one line naming the first parts that
    differ (an edited run.json), before any weight is loaded."""
    a, b = stored.identity(), made.identity()
    if a["space"] is None:
        b["space"] = None
    diff = differences(a, b)
    if diff:
        raise ELFError(f"{ckpt.parent.parent / RUN_FILE}: its training settings make another model than its checkpoint "
                       f"{ckpt.name} holds ({'; '.join(diff[:3])}); run.json was edited: restore it")


def save(out: Path, step: int, setup: Setup, data_position: dict | None = None) -> Path:
    """The checkpoint of `step`; `data_position` is the data iterator's state after that step's batch (its
    own state by default; a prefetching loop has read ahead)."""
    position = data_position if data_position is not None else setup.batches.state_dict()
    state = checkpoint_state(setup.record, step, position, store_record(setup.batches.dataset), setup.world)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return save_checkpoint(out, setup.net.state_dict(), setup.ema.state_dict(),
                           {"optimizer": setup.optimizer.state_dict(), "rng": rng}, state, keep=setup.cfg.keep,
                           space_sd=setup.space.trainable_state_dict())


def run_record(setup: Setup) -> RunRecord:
    """The run's description, made once from its config and what set-up built: the network, the space, the
    recipe, the task, the distillation and the sampling defaults of its kind, with those given
    (--sample-steps, --sample-sampler, --sample-omega) on top."""
    cfg = setup.cfg
    config, options = setup.method.network_of(setup.net)
    record = RunRecord(setup.method.name, config, SpaceSpec.of_space(setup.space), setup.length, setup.recipe,
                       options or ShortRunOptions(), cfg.task, None, cfg.distillation,
                       ParamCounts.from_dict(setup.params)).with_default_sampling()
    given = cfg.sampling.given()
    if not given:
        return record
    stored = record.sampling.to_dict()
    for key in given:
        if key not in stored:
            raise ELFError(f"--sample-{key} does not apply to a model of --method {record.method}; leave it out")
    record = record.replace(sampling=type(record.sampling).from_dict({**stored, **given}))
    record.check("the run's sampling settings", {"sampling": " ".join(f"--sample-{k} {v}" for k, v in given.items())})
    return record


# ----------------------------------------------------------------------------------------------------------
# the loop


def _reduce(totals: dict, world: int) -> dict:
    """Sums over ranks of the log's tensors in one all_reduce; the loss and gradient norm averaged."""
    keys = sorted(totals)
    flat = torch.cat([totals[k].reshape(-1).float() for k in keys])
    dist.all_reduce(flat)
    parts = flat.split([totals[k].numel() for k in keys])
    return {k: p.reshape(totals[k].shape) / (world if k in ("loss", "grad_norm") else 1) for k, p in zip(keys, parts)}


def train_loop(setup: Setup, out: Path, start: int, quiet: bool = False, stop_after: int | None = None,
               on_checkpoint=None, time_limit: float | None = None, tracker=None) -> dict:
    """Steps start .. end of the schedule; rank 0 logs and saves. `on_checkpoint(path)` follows each save.
    `time_limit` (seconds): end (with a checkpoint) after the first step that finishes past it (under
    several ranks, the first logging step past it). `tracker`: rank 0's W&B run (elflow.runs.tracking.Tracker),
    finished when the loop ends.

    A step reads nothing on the host. The loop reads the device's numbers where it must: on logging steps
    (the log's sums, reduced over ranks in one all_reduce, and with them whether any step since the last
    reading was not finite; every checkpoint's step is one, so a resumed run logs the lines of an
    uninterrupted one), and before samples; a step that was not finite stops the run there, before anything
    of it is saved."""
    cfg, world, device = setup.cfg, setup.world, setup.device
    model = trained_module(setup)
    params = [p for _, p in setup.named]
    log = RunLogger(out, setup.steps, start, setup.rank == 0, cfg.tensorboard, show=not quiet, tracker=tracker)
    window = LogWindow(setup, log, start, out)
    end = setup.steps if stop_after is None else min(setup.steps, start + stop_after)
    summary = {"start_step": start}
    t_start = time.perf_counter()
    ok = False
    batches = Prefetch(setup.batches, end - start, micro=setup.micro, accum=setup.accum, pin=device.type == "cuda")
    try:
        for step in range(start, end):
            setup.optimizer.set_lr(setup.lr_at(step))
            shards, position = next(batches)
            window.add(train_step(model, shards, setup.optimizer, setup.ema, step, cfg.seed, setup.rank * setup.accum,
                                  setup.dtype, cfg.grad_clip, world, device, params))
            done = step + 1
            # a checkpoint's step is a logging step too: the log's intervals restart where a resume starts
            logging = done % cfg.log_every == 0 or done % cfg.ckpt_every == 0 or done == end
            if time_limit is not None and done < end and (world == 1 or logging) and \
                    time_is_up(t_start, time_limit, world, device):
                end, logging = done, True
            saving = done % cfg.ckpt_every == 0 or done == end
            sampling = bool(cfg.sample_every) and done % cfg.sample_every == 0 and log.wants_samples
            if logging:
                summary["last"] = window.write(done, setup.lr_at(step))
            elif sampling and world == 1:  # read before anything of these steps leaves the loop
                window.check_finite(done)
            if sampling:
                show_samples(setup, log, done)
            if saving and setup.rank == 0:
                window.last_good = save(out, done, setup, position)
                if on_checkpoint is not None:
                    on_checkpoint(window.last_good)
                plot_losses(out)
            if world > 1 and saving:
                dist.barrier()
            if done == end:
                break
        ok = True
    except (OSError, NoSpace) as e:
        if disk_full(e):
            raise no_space(e, out) from None
        raise
    finally:
        batches.close()
        log.close(ok)
    summary.update(end_step=end, out=str(out))
    return summary


def trained_module(setup: Setup) -> torch.nn.Module:
    """The trained pass as a module's forward (the space's encode inside it), compiled with --compile and
    wrapped in DDP under several ranks."""
    model = TrainedPass(setup.method, setup.net, setup.space, setup.recipe)
    if setup.cfg.compile:
        model = torch.compile(model)
    if setup.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # the batch is on the device already and the draw's discrete choices stay on the CPU: no device_ids,
        # so DDP moves no input; the only buffers are constant (RoPE tables, a frozen encoder's): no
        # per-forward broadcast (forward counts differ by rank)
        model = DDP(model, device_ids=None, broadcast_buffers=False)
    return model


def time_is_up(t_start: float, time_limit: float, world: int, device) -> bool:
    """Whether `time_limit` seconds have passed since `t_start`; under several ranks, whether they have on any
    rank (every rank stops at the same step)."""
    over = time.perf_counter() - t_start >= time_limit
    if world > 1:
        flag = torch.tensor([float(over)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        over = bool(flag.item())
    return over


class LogWindow:
    """The steps since the last log line: their metrics summed on the device, read (and reduced over ranks)
    when the line is written; the last step known to be finite and the last checkpoint written, for the
    message that stops a run at a non-finite step."""

    def __init__(self, setup: Setup, log: RunLogger, start: int, out: Path):
        self.setup, self.log = setup, log
        self.totals, self.n, self.t0 = {}, 0, time.perf_counter()
        self.checked, self.last_good = start, None
        self.before = f"{checkpoint_dir(out, start)} (the one this run resumed from)" if start else \
            "none (no checkpoint was saved yet)"

    def add(self, metrics: dict) -> None:
        for k, v in metrics.items():
            self.totals[k] = self.totals[k] + v if k in self.totals else v
        self.n += 1

    def check_finite(self, done: int, nonfinite=None) -> None:
        """Stop the run (ELFError) if any step since the last check was not finite."""
        nonfinite = self.totals["nonfinite"] if nonfinite is None else nonfinite
        if nonfinite.item():
            what = f"at step {done}" if done == self.checked + 1 else f"in steps {self.checked + 1}..{done}"
            raise ELFError(f"non-finite loss or gradient {what}; stopping without saving. The last good "
                           f"checkpoint is {self.last_good or self.before}; try a lower --lr "
                           "or --dtype fp32, then --resume.")
        self.checked = done

    def write(self, done: int, lr: float) -> dict:
        """The log line of the steps since the last one (after the finiteness check); a new window starts."""
        setup = self.setup
        totals = _reduce(self.totals, setup.world) if setup.world > 1 else self.totals
        self.check_finite(done, totals.pop("nonfinite"))
        rec = summarize(totals, self.n, setup.method)
        dt = time.perf_counter() - self.t0
        rec.update(step=done, lr=lr, tokens_per_s=setup.cfg.batch * setup.length * self.n / dt, elapsed=dt)
        self.log.log({"kind": "train", **rec})
        self.log.advance(self.n, {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"})
        self.totals, self.n, self.t0 = {}, 0, time.perf_counter()
        return rec


def train(cfg: TrainConfig, out: str | os.PathLike, resume: bool = False, overwrite: bool = False,
          cache_dir=None, quiet: bool = False, stop_after: int | None = None, device: str | None = None,
          command: str = "elflow train", method: Method | None = None, time_limit: float | None = None,
          init: tuple | None = None) -> dict:
    """Train; returns a summary dict (rank 0). `stop_after` ends the process's work after that many steps
    of this invocation (for tests and time-boxed runs) while keeping the schedule of `cfg.steps`;
    `time_limit` (seconds) ends it after the first step past it (a wall-clock budget). `method` trains with
    another method object than the config's (a distillation round's elflow.methods.pd.PDMethod); `init` the
weights `cfg.init_from` names, already read (`start_from`).

    Everything is checked before the run folder changes; --overwrite sets the old run aside and drops it
    only once the new run's first checkpoint is written (it comes back if the new run fails before). A
    --decoder separate run without --decoder-from trains its decoder first, into OUT/decoder (`decoder_stage`,
    continued there on --resume), then the denoiser against it; both stages are stored as one model.
    Training runs with CPU denormals flushed to zero (`flushed_denormals`): no value training keeps is that
    small, and a CPU step stays at full speed."""
    out = Path(out)
    cfg = absolute_paths(cfg.resolved())  # the paths it records name the same files from any folder
    cfg.validate()
    if cfg.wandb:
        require_wandb()
    device = check_device(device)
    method = method if method is not None else get_method(cfg.method)
    decoder_from = None
    with flushed_denormals():
        if cfg.separate_decoder and not cfg.init_from:  # (a run started from weights has its decoder in them)
            decoder_from = Path(cfg.decoder_from) if cfg.decoder_from else out / DECODER_STAGE
            if not cfg.decoder_from:
                check_run_dir(out, cfg, resume, overwrite)  # before the first stage writes anything
                began = time.perf_counter()
                stage = train_one(decoder_stage(cfg), decoder_from, get_method(cfg.method),
                                  (decoder_from / RUN_FILE).exists() and not overwrite, overwrite, cache_dir,
                                  quiet, stop_after, device, f"{command} (decoder stage)", time_limit, stage_of=cfg)
                if stage["end_step"] < decoder_stage(cfg).steps:  # stopped inside the first stage
                    return stage
                resume = resume or not overwrite  # the second stage starts, or continues, in a folder it owns
                if time_limit is not None:  # one wall-clock budget for both stages
                    time_limit -= time.perf_counter() - began
                    if time_limit <= 0:
                        return stage
                if stop_after is not None:
                    stop_after -= stage["end_step"] - stage["start_step"]
                    if stop_after <= 0:
                        return stage
        return train_one(cfg, out, method, resume, overwrite, cache_dir, quiet, stop_after, device, command,
                         time_limit, decoder_from=decoder_from, init=init)


def train_one(cfg: TrainConfig, out: Path, method: Method, resume: bool, overwrite: bool, cache_dir, quiet: bool,
              stop_after: int | None, device: str | None, command: str, time_limit: float | None,
              decoder_from: Path | None = None, stage_of: TrainConfig | None = None, init: tuple | None = None) -> dict:
    """One run in one folder (`train`'s body for each stage). `stage_of`: the settings of the run whose first
    stage this is, stored with the stage (what --resume reads while the run is in that stage)."""
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
        if claim["checkpoint"]:  # the store it was trained on, before its data is read (not a hub lookup)
            ckpt_dir = out / CHECKPOINTS / claim["checkpoint"]
            check_recorded_store(claim["state"].get("data_store"), cfg.data, ckpt_dir / STATE_FILE)
        if rank == 0 and cfg.epochs is None and cfg.warmup_frac is None and cfg.steps < cfg.warmup:
            print(f"warning: --steps {cfg.steps} is shorter than --warmup {cfg.warmup}: the learning rate stops at "
                  f"{lr_at(cfg.steps - 1, cfg.lr, cfg.warmup, schedule=cfg.lr_schedule):.3g}, never reaching {cfg.lr:.3g}", file=sys.stderr)
        setup = set_up(cfg, method, rank, world, dev, cache_dir, decoder_from)
        if not resume and cfg.init_from:  # read before a replaced run is set aside (it may be the one in --out)
            start_from(setup, cfg.init_from, quiet, init)
        if overwrite and (out / RUN_FILE).exists():
            on_rank0(folder.set_aside, rank, world)
        ckpt = out / CHECKPOINTS / claim["checkpoint"] if claim["checkpoint"] else None
        start = restore(setup, ckpt, claim["state"], quiet)
        if resume and start == 0 and cfg.init_from:
            start_from(setup, cfg.init_from, quiet, init)
        if resume and rank == 0:
            trim_metrics(out, start)
        if rank == 0 and not quiet:
            print(describe_start(setup), file=sys.stderr)
        tracker = [None]
        if cfg.wandb:  # started before the run folder is written: a refused start leaves no run behind
            def start_tracker():
                tracker[0] = Tracker.start(cfg.wandb, cfg.wandb_run, out, tracked_settings(setup), job_type="train",
                                           keep_id=True, quiet=quiet)

            on_rank0(start_tracker, rank, world)

        files = run_files(cfg.tensorboard, bool(cfg.wandb))
        if resume and (out / RUN_FILE).exists():  # and what the run wrote before (a resume may turn logs off)
            files = (*stored_files(out), *files)

        def write_meta():
            if claim["state"] is not None and (out / RUN_FILE).exists():  # a resume: reading never makes it worse
                folder.keep_earlier_run(claim["state"]["step"])
            write_run(out, setup.record, setup.cfg.beside(setup.record), files, world_size=world,
                      **({"stage_of": stage_of.to_dict()} if stage_of else {}))

        try:
            on_rank0(write_meta, rank, world)
        except BaseException as e:
            if tracker[0] is not None:
                tracker[0].finish(ok=False)
            if isinstance(e, (OSError, NoSpace)) and disk_full(e):
                raise no_space(e, out) from None
            raise
        summary = train_loop(setup, out, start, quiet, stop_after, on_checkpoint=lambda _: folder.commit(),
                             time_limit=time_limit, tracker=tracker[0])
        ok = True
        return summary
    except RuntimeError as e:  # a collective whose peer died (a rank killed): one line on the survivors
        raise_if_peer_lost(e, world, rank, f"elflow train --out {out} --resume")
        raise
    finally:
        if rank == 0:
            folder.close(ok)
        if world > 1 and dist.is_initialized() and owns_group:
            destroy_group(ok)


def show_samples(setup: Setup, log, step, num: int = 2):
    log.samples(step, setup.method.preview(setup.net, setup.ema, setup.space, num, setup.length, setup.record,
                                           setup.cfg.seed))
