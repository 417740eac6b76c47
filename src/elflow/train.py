"""TODO."""

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
from elflow.flow import Recipe
from elflow.methods.base import Method, TrainedPass
from elflow.methods import get_method
from elflow.model import get_config
from elflow.optim import EMA, ELFOptimizer, lr_at
from elflow.config import TrainConfig
from elflow.runs.folder import DECODER_STAGE, RunFolder, check_run_dir, no_space
from elflow.runs.log import RunLogger, plot_losses, trim_metrics
from elflow.util.errors import ELFError, first_line
from elflow.util.files import NoSpace, atomic_write_json, no_space_error
from elflow.util.devices import autocast, check_device, device_name, fast_bf16, flushed_denormals, resolve_dtype, use_tf32
from elflow.util.distributed import on_every_rank, on_rank0, setup_distributed
from elflow.data.batches import Prefetch
from elflow.runs.folder import claim_run, micro_batch_for, shared_folder_check
from elflow.runs.stages import attach_decoder, decoder_stage


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
    from elflow.data.batches import Batches
    from elflow.space import build_space, space_spec

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
    from elflow.data.datasets import build_dataset, build_pairs

    if cfg.source_length:
        return build_pairs(cfg.data, space, cfg.source_length, length, val_fraction=cfg.val_fraction,
                           seed=cfg.seed, cache_dir=cache_dir, source_field=cfg.source_field,
                           target_field=cfg.target_field, on_bad=cfg.on_bad, source_slot=cfg.source_slot)
    return build_dataset(cfg.data, space, length, layout=cfg.layout, val_fraction=cfg.val_fraction,
                         seed=cfg.seed, cache_dir=cache_dir, field=cfg.text_field, on_bad=cfg.on_bad)


def start_from(run: Setup, path, quiet: bool = False) -> None:
    """Load stored weights into a fresh run (`--init-from`): its EMA starts from them; the optimiser is new."""
    from elflow.runs.load import check_init_compatible, load_init_weights

    init_cfg, init_sd, info = load_init_weights(path, warn=lambda m: run.rank == 0 and print(m, file=sys.stderr))
    check_init_compatible(path, init_cfg, info, run.net, run.space)
    run.net.load_state_dict(init_sd)
    run.ema = EMA(run.net, run.cfg.ema_decay)
    if run.rank == 0 and not quiet:
        print(f"starting from the weights of {info['checkpoint']}", file=sys.stderr)


def restore(run: Setup, ckpt: Path | None, quiet: bool = False) -> int:
    """Load the checkpoint `ckpt` (rank 0's choice, `claim_run` / `resume_point`) into the run; returns its step
    (0 for none)."""
    from safetensors.torch import load_file

    from elflow.runs.checkpoint import load_checkpoint, split_space_state
    from elflow.space import check_compatible

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
    from elflow.runs.checkpoint import save_checkpoint

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
        from elflow.runs.tracking import require

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
            from elflow.runs.tracking import Tracker

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
