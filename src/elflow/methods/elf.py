"""ELF as a method: flow matching in an embedding space (elflow.flow) with the network of elflow.model.

A training step of one shard: `draw` (outside torch.compile and DDP) draws times, noise, branches and dropped
sources; `loss` encodes the batch (a dropped source hidden from its target), applies the objective (ELF's
own, or distillation's through `with_objective`) and returns the sums the log reads (`step_sums`). The
network as stored with a run (its config and options) is read and written here too.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from elflow.data.layout import encoder_mask
from elflow.flow import TIME_BINS, Recipe, draw_training_noise, elf_loss, generate_tokens, time_bin, time_bin_labels
from elflow.generate import ELF_KNOBS, generate, settings_for
from elflow.methods.base import FEATURES, Method
from elflow.model import ELFConfig, ShortRunOptions, build_network, check_network, options_of
from elflow.space import latent_moments, learned, token_vectors
from elflow.util.devices import check_memory
from elflow.util.errors import ELFError


@dataclass(frozen=True)
class Objective:
    """What a training step minimises. `draw(shape, recipe, generator=, cpu_generator=, device=, conditional=)`
    draws a batch's randomness (with `t`, `decode` and a `drop_source` (B,) CPU bool tensor, read by the
    encoder mask); `loss(net, x, tokens, draw, recipe, valid=, known=)` returns (loss, rows) as elf_loss does."""

    draw: Callable = draw_training_noise
    loss: Callable = elf_loss


def step_sums(loss: torch.Tensor, rows: dict, draw) -> dict:
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


# the output heads and the input and scalar embedders (the parameters --adam-heads gives to Adam)
HEAD_PREFIXES = ("x_head.", "head_modulation.", "decode_head.", "self_cond_proj.", "bottleneck_in.",
                 "bottleneck_out.", "time_embed.", "omega_embed.")


class ELFMethod(Method):
    name = "elf"
    title = "an ELF model"
    features = frozenset(FEATURES)
    knobs = ELF_KNOBS
    sweep_axes = ("sampler", "steps", "omega")
    sweep_fixed = ("gamma", "grid")

    def __init__(self, objective: Objective | None = None):
        self.objective = objective or Objective()

    def with_objective(self, objective) -> "ELFMethod":
        return ELFMethod(objective)

    # -- the run ----------------------------------------------------------------------------------------------
    def check(self, cfg) -> None:
        check_network(cfg.predict, cfg.conditioning, options_of(cfg.short_run))
        if cfg.separate_decoder:
            if "decode_prob" in cfg.recipe:
                raise ELFError("--decode-prob does not go with --decoder separate: its decoder trains alone "
                               "(--decoder-steps) and its denoiser never decodes")
            if cfg.decoder_from and cfg.decoder_steps:
                raise ELFError("--decoder-steps trains a decoder, --decoder-from takes a trained one: pass one of them")
            if cfg.distillation or cfg.source_length:
                raise ELFError("--decoder separate trains unconditional models from scratch (no --source-length, no "
                               "distillation)")
            if cfg.epochs is not None and not (cfg.decoder_steps or cfg.decoder_from):
                raise ELFError("--decoder separate with --epochs needs --decoder-steps (the decoder stage's length)")
            if learned(cfg.space or "minilm"):
                raise ELFError("--decoder separate needs a frozen space: a learned table would move under the "
                               "frozen decoder while the denoiser trains")
        elif cfg.decoder_steps or cfg.decoder_from:
            raise ELFError(f"--{'decoder-steps' if cfg.decoder_steps else 'decoder-from'} needs --decoder separate")
        if "source_drop_prob" in cfg.recipe and not cfg.source_length:
            raise ELFError("--source-drop-prob applies to runs on (source, target) pairs (--source-length)")

    def build(self, cfg, shape, space, data, recipe, device):
        options = options_of(cfg.short_run)
        check_network_memory(shape, options)
        net = build_network(shape, options).to(device)
        net.grad_checkpoint = cfg.grad_checkpoint
        for part in net.parts():  # the short-run options' data: the training split's moments, token vectors
            if part.options.skip != "none":
                part.set_gaussian_skip(*latent_moments(space, data, device=device), recipe.noise_scale)
            if part.options.table_readout:
                part.set_readout_table(token_vectors(space, part.config.vocab_size, device=device))
        n = net.num_params()
        return net, {"model": n, "elf": n, "match": cfg.match}

    def describe(self, net) -> dict:
        shape, options = describe_network(net)
        return {"model": shape, **({"short_run": options} if options else {})}

    def stored_config(self, state: dict):
        cfg, options = stored_network(state["model"], state.get("short_run"))
        return cfg, ({"short_run": options.to_dict()} if options.active else {})

    def load(self, config, state_dict, settings):
        return network_from_state_dict(state_dict, config, settings.get("short_run"))

    def fits(self, space, net) -> None:
        cfg = net.config
        if space.dim != cfg.dim or space.vocab_size < cfg.vocab_size:
            raise ELFError(f"the embedding space ({space.space_id}: dim {space.dim}, vocabulary {space.vocab_size}) "
                           f"does not fit the network (dim {cfg.dim}, vocabulary {cfg.vocab_size})")

    def adam_names(self, net, cfg) -> list[str]:
        """Under --adam-heads, the output heads and the input and scalar embedders (a separate decoder's
        denoiser's by their own names)."""
        return [n for n, _ in net.named_parameters()
                if cfg.adam_heads and n.removeprefix("denoiser.").startswith(HEAD_PREFIXES)]

    # -- a training step ----------------------------------------------------------------------------------
    def draw(self, batch, space, recipe, generator, cpu_generator):
        tokens = batch["tokens"]
        B, L = tokens.shape
        return self.objective.draw((B, L, space.dim), recipe, generator=generator, cpu_generator=cpu_generator,
                                   device=tokens.device, conditional=batch.get("known") is not None)

    def loss(self, net, space, batch, draw, recipe):
        tokens, mask = batch["tokens"], batch.get("mask")  # mask: the positions the loss scores
        attention = batch.get("attention_mask")  # real tokens: the keys the encoder may attend to
        known = batch.get("known")  # the source positions of conditional data
        if known is not None:
            valid = attention if attention is not None else torch.ones_like(known)
            attention = encoder_mask(known, valid, draw.drop_source)
        with nullcontext() if space.trainable else torch.no_grad():
            x = space.encode(tokens, attention)
        loss, rows = self.objective.loss(net, x.float(), tokens, draw, recipe, valid=mask, known=known)
        return loss, step_sums(loss, rows, draw)

    def summarize(self, t: dict) -> dict:
        rec = {}
        if t["denoise_n"]:
            rec["loss_denoise"] = t["denoise_sum"] / t["denoise_n"]
        if t["decode_n"]:
            rec["loss_decode"] = t["decode_sum"] / t["decode_n"]
        if t["decode_tokens"]:
            rec["decode_acc"] = t["decode_correct"] / t["decode_tokens"]
        for label, s, n in zip(time_bin_labels(), t["bin_sum"], t["bin_n"]):
            rec[f"loss_{label}"] = s / n if n else None
        return rec

    @torch.no_grad()
    def preview(self, net, ema, space, num, length, cfg) -> list[str]:
        """`num` samples of the EMA weights with the run's sample_* settings and noise scale, from one generator
        seeded by the run's seed."""
        device = next(net.parameters()).device
        sampler_net = build_network(net.config, net.options).to(device)
        ema.copy_to(sampler_net)
        sampler_net.eval()
        g = torch.Generator(device=device).manual_seed(cfg.seed)
        tokens, _ = generate_tokens(sampler_net, num, length, cfg.sample_steps, cfg.sample_sampler,
                                    omega=cfg.sample_omega, generator=g, recipe=Recipe.from_dict(cfg.recipe))
        return space.decode(tokens.cpu())

    # -- sampling -----------------------------------------------------------------------------------------
    def settings(self, loaded, seed=None, batch_size=None, **given):
        self.check_knobs(given)
        return settings_for(loaded, seed=seed, batch_size=batch_size, **given)

    def sample(self, net, space, num, settings, length=None, progress=True, part=(0, 1), **known) -> list[dict]:
        return generate(net, space, num, settings, length, progress=progress, part=part, **known)


METHOD = ELFMethod()


# ----------------------------------------------------------------------------------------------------------
# the network as stored with a run


def describe_network(net) -> tuple[dict, dict]:
    """(the network's config, its short-run options; {} for the paper's network) as stored with a run."""
    return net.config.to_dict(), net.options.to_dict() if net.options.active else {}


RUN_ONLY = ("grad_checkpoint",)  # a setting of the run that earlier elflows stored with the network config


def stored_network(model: dict, short_run: dict | None = None) -> tuple[ELFConfig, ShortRunOptions]:
    """(ELFConfig, ShortRunOptions) of a stored network: its "model" config and its "short_run" options."""
    try:
        return ELFConfig.from_dict({k: v for k, v in model.items() if k not in RUN_ONLY}), options_of(short_run)
    except ValueError as e:
        raise ELFError(f"the stored network config cannot be read: {e}") from None


def network_bytes(config: ELFConfig, options: ShortRunOptions | None = None) -> int:
    """The fp32 bytes of the weights and buffers of a network, counted without memory: one block is built on
    the meta device and the others counted as its copies."""
    with torch.device("meta"):
        one = build_network(config.replace(depth=1), options)
        block = one.parts()[0].blocks[0]
        per = sum(t.numel() for t in list(block.parameters()) + list(block.buffers()))
        total = sum(t.numel() for t in list(one.parameters()) + list(one.buffers()))
    return 4 * (total + len(one.parts()) * (config.depth - 1) * per)


def check_network_memory(config: ELFConfig, options: ShortRunOptions | None = None) -> None:
    """Refuse, before anything is allocated, a network whose weights alone need more memory than this machine
    has (a mistyped --depth, --hidden, or a stored config of such numbers)."""
    what = ", ".join(f"{k} {getattr(config, k)}" for k in ("depth", "hidden", "heads", "dim", "vocab_size",
                                                               "max_length"))
    check_memory(network_bytes(config, options), f"a network of {what}",
                 hint="choose a smaller --depth / --hidden / --length (or check the stored config)")


def network_from_state_dict(sd: dict[str, torch.Tensor], config: ELFConfig, options=None):
    """The network of `config` and `options` holding these (elflow-named) weights; weights that fit no such
    network are a one-line error."""
    options = options_of(options)
    check_network_memory(config, options)
    net = build_network(config, options)
    expected = net.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise ELFError(f"weights do not fit an ELF network of shape {config}: missing {missing[:6]}, "
                       f"unexpected {unexpected[:6]}")
    wrong = [f"{k}: {tuple(sd[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
             if sd[k].shape != v.shape]
    if wrong:
        raise ELFError(f"weights have shapes that fit no ELF network of this shape: {wrong[:4]}")
    net.load_state_dict(sd)
    return net

