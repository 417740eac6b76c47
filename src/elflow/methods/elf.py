"""TODO."""

from __future__ import annotations
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable
import torch
from elflow.data.layout import encoder_mask
from elflow.space import space_spec
from elflow.flow import TIME_BINS, Recipe, draw_training_noise, elf_loss, generate_tokens, time_bin, time_bin_labels
from elflow.generate import ELF_KNOBS, generate, settings_for
from elflow.methods.base import FEATURES, Method
from elflow.optim import HEAD_PREFIXES
from elflow.model import ELFConfig
from elflow.model import build_network, check_network, describe_network, options_of
from elflow.runs.load import network_from_state_dict, stored_network
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
        check_network(ELFConfig(predict=cfg.predict, conditioning=cfg.conditioning), options_of(cfg.short_run))
        if cfg.decoder == "separate":
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
            if space_spec(cfg.space or "minilm", None)["kind"] == "learned-table":
                raise ELFError("--decoder separate needs a frozen space: a learned table would move under the "
                               "frozen decoder while the denoiser trains")
        elif cfg.decoder_steps or cfg.decoder_from:
            raise ELFError(f"--{'decoder-steps' if cfg.decoder_steps else 'decoder-from'} needs --decoder separate")
        if "source_drop_prob" in cfg.recipe and not cfg.source_length:
            raise ELFError("--source-drop-prob applies to runs on (source, target) pairs (--source-length)")

    def build(self, cfg, shape, space, data, recipe, device):
        net = build_network(shape, cfg.short_run).to(device)
        net.grad_checkpoint = cfg.grad_checkpoint
        if hasattr(net, "prepare"):  # the short-run options' data: the training split's moments, token vectors
            net.prepare(space, data, recipe.noise_scale)
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
        sampler_net = build_network(net.config, getattr(net, "options", None)).to(device)
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
