"""ELF as a method: flow matching in an embedding space (elflow.flow) with the network of elflow.model.

A training step of one shard: `draw` (outside torch.compile and DDP) draws times, noise, branches and dropped
sources (`flow.draw_training_noise`); the trained pass (`Method.loss`) encodes the batch (`inputs`: a dropped
source hidden from its target), applies ELF's objective (`objective`: `flow.elf_loss`) and returns the sums the
log reads (`sums`: `step_sums`). A distillation is a method of its own on the same network, with its own draw
and objective (elflow.methods.pd and elflow.methods.lmd). The network as a record stores it is read and built
here too.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from elflow.data.layout import encoder_mask
from elflow.flow import (
    DISTILLED_STEPS,
    FLOW_MAP_STEPS,
    TIME_BINS,
    Recipe,
    draw_training_noise,
    elf_loss,
    time_bin,
    time_bin_labels,
)
from elflow.generate import ELF_KNOBS, GenerationDefaults, default_sampling, generate, settings_for
from elflow.methods.base import FEATURES, Method
from elflow.model import ELFConfig, ShortRunOptions, build_network, check_network, options_of
from elflow.sampler import generate_tokens
from elflow.space import latent_moments, learned, token_vectors
from elflow.util.budget import Estimate, check_fits
from elflow.util.errors import ELFError


def step_sums(loss: torch.Tensor, rows: dict, draw) -> dict:
    """Per-row sums of one shard (`flow.token_mean_loss`'s rows) -> sums and counts that add up across shards,
    steps and ranks; no host sync. Each branch's loss is kept as the authors log it, a sum over the scored
    positions of the branch's rows and their count (one token mean per log line), and as the sum of each row's
    own token mean and the row count (the mean of the rows' means); the time bins hold rows' means."""
    dev = loss.device
    is_dec = draw.decode.to(dev)
    den = (~is_dec).float()
    scored = rows["scored"]
    row_mean = {k: rows[k] / scored.clamp_min(1) for k in ("denoise", "decode")}
    bins = time_bin(draw.t.detach())
    nb = len(TIME_BINS) - 1
    return {
        "loss": loss.detach(),
        "denoise_sum": rows["denoise"].sum(), "denoise_tokens": (scored * den).sum(),
        "decode_sum": rows["decode"].sum(), "decode_tokens": (scored * is_dec.float()).sum(),
        "denoise_row_sum": row_mean["denoise"].sum(), "denoise_rows": den.sum(),
        "decode_row_sum": row_mean["decode"].sum(), "decode_rows": is_dec.float().sum(),
        "decode_correct": rows["correct"].sum(),
        "bin_sum": torch.zeros(nb, device=dev).index_add(0, bins, row_mean["denoise"] * den),
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

    # -- the run ----------------------------------------------------------------------------------------------
    def check(self, cfg) -> None:
        check_network(cfg.network.predict or ELFConfig.predict, cfg.network.conditioning or ELFConfig.conditioning,
                      options_of(cfg.short_run))
        if cfg.separate_decoder:
            # (0, every row denoising, is what the record of such a run holds: its settings read back)
            if cfg.recipe is not None and cfg.recipe.decode_prob not in (Recipe().decode_prob, 0.0):
                raise ELFError("--decode-prob does not go with --decoder separate: its decoder trains alone "
                               "(--decoder-steps) and its denoiser never decodes")
            if cfg.decoder_from and cfg.decoder_steps:
                raise ELFError("--decoder-steps trains a decoder, --decoder-from takes a trained one: pass one of them")
            if cfg.distillation or cfg.conditional:
                raise ELFError("--decoder separate trains unconditional models from scratch (no --source-length, no "
                               "distillation)")
            if cfg.epochs is not None and not (cfg.decoder_steps or cfg.decoder_from):
                raise ELFError("--decoder separate with --epochs needs --decoder-steps (the decoder stage's length)")
            if cfg.space is not None and learned(cfg.space):  # (the sizes' default spaces are frozen)
                raise ELFError("--decoder separate needs a frozen space: a learned table would move under the "
                               "frozen decoder while the denoiser trains")
        elif cfg.decoder_steps or cfg.decoder_from:
            raise ELFError(f"--{'decoder-steps' if cfg.decoder_steps else 'decoder-from'} needs --decoder separate")
        if cfg.recipe is not None and cfg.recipe.source_drop_prob != Recipe().source_drop_prob and \
                not cfg.conditional:
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

    # -- the network as a record stores it -------------------------------------------------------------
    config_type = ELFConfig
    sampling_type = GenerationDefaults

    def network_of(self, net):
        return net.config, net.options

    def build_network(self, record, max_length=None):
        config = record.network.widened(max_length)
        check_network_memory(config, record.options)
        return build_network(config, record.options)

    # self-conditioning follows from the recipe's self_cond_prob, the path's constants (read by a v- or eps-head
    # alone: an x head holds None) from the recipe, and a flow map's target time from the distillation objective
    derived = ("self_cond", "target_time", "noise_scale", "t_eps")

    def derive(self, recipe, distillation) -> dict:
        return {"self_cond": recipe.self_conditioned, "noise_scale": recipe.noise_scale, "t_eps": recipe.t_eps,
                "target_time": distillation is not None and distillation.objective == "flow-map"}

    def check_record(self, record) -> None:
        check_network(record.network.predict, record.network.conditioning, record.options)
        record.sampling.check(record.recipe)
        if record.sampling.sampler == "map" and not record.network.target_time:
            e = ELFError("its sampling defaults jump with the map sampler, which needs a flow-map student (elflow "
                         "distill --objective flow-map); choose sde, ode or vc")
            e.field = "sampling"  # (the sampling defaults are at fault, not the network)
            raise e

    def default_sampling(self, record):
        d = record.distillation
        pd = (d.student_steps or DISTILLED_STEPS) if d and d.objective == "pd" else None
        fm = (d.student_steps or FLOW_MAP_STEPS) if d and d.objective == "flow-map" else None
        return default_sampling(record.conditional, pd, record.recipe.self_conditioned, fm)

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
        return draw_training_noise((B, L, space.dim), recipe, generator=generator, cpu_generator=cpu_generator,
                                   device=tokens.device, conditional=batch.get("known") is not None)

    def inputs(self, space, batch, draw):
        return self.encode(space, batch, draw)

    def objective(self, net, x, batch, draw, recipe):
        return elf_loss(net, x, batch["tokens"], draw, recipe, valid=batch.get("mask"), known=batch.get("known"))

    def sums(self, loss, rows, draw):
        return step_sums(loss, rows, draw)

    @staticmethod
    def encode(space, batch, draw) -> torch.Tensor:
        """The batch's clean embeddings (B, L, C) in fp32: a conditional row's source encoded seeing only itself
        and hidden from its target where the draw drops it (`data.layout.encoder_mask`)."""
        attention = batch.get("attention_mask")  # real tokens: the keys the encoder may attend to
        known = batch.get("known")  # the source positions of conditional data
        if known is not None:
            valid = attention if attention is not None else torch.ones_like(known)
            attention = encoder_mask(known, valid, draw.drop_source)
        with nullcontext() if space.trainable else torch.no_grad():
            return space.encode(batch["tokens"], attention).float()

    def summarize(self, t: dict) -> dict:
        rec = {}
        for branch in ("denoise", "decode"):  # the authors' token mean, and the mean of the rows' means
            if t[f"{branch}_tokens"]:
                rec[f"loss_{branch}"] = t[f"{branch}_sum"] / t[f"{branch}_tokens"]
            if t[f"{branch}_rows"]:
                rec[f"loss_{branch}_rows"] = t[f"{branch}_row_sum"] / t[f"{branch}_rows"]
        if t["decode_tokens"]:
            rec["decode_acc"] = t["decode_correct"] / t["decode_tokens"]
        for label, s, n in zip(time_bin_labels(), t["bin_sum"], t["bin_n"]):
            rec[f"loss_{label}"] = s / n if n else None
        return rec

    @torch.no_grad()
    def preview(self, net, ema, space, num, length, record, seed) -> list[str]:
        device = next(net.parameters()).device
        sampler_net = build_network(net.config, net.options).to(device)
        ema.copy_to(sampler_net)
        sampler_net.eval()
        g = torch.Generator(device=device).manual_seed(seed)
        s = record.sampling
        tokens, _ = generate_tokens(sampler_net, num, length, s.steps, s.sampler, s.gamma, s.omega, s.grid,
                                    generator=g, recipe=record.recipe)
        return space.decode(tokens.cpu())

    # -- sampling -----------------------------------------------------------------------------------------
    def sampling_settings(self, record, seed=None, batch_size=None, **given):
        self.check_knobs(given)
        return settings_for(record, seed=seed, batch_size=batch_size, **given)

    def generate(self, net, space, num, settings, length=None, progress=True, part=(0, 1), **known) -> list[dict]:
        return generate(net, space, num, settings, length, progress=progress, part=part, **known)


METHOD = ELFMethod()


# ----------------------------------------------------------------------------------------------------------
# the network's size

def network_bytes(config: ELFConfig, options: ShortRunOptions | None = None) -> int:
    """The fp32 bytes of the weights and buffers of a network, counted without memory: one block is built on
    the meta device and the others counted as its copies."""
    try:
        with torch.device("meta"):
            one = build_network(config.replace(depth=1), options)
    except RuntimeError as e:  # a tensor of more elements than an address holds: past any machine's memory
        if "overflow" not in str(e):
            raise
        return 2**63
    block = one.parts()[0].blocks[0]
    per = sum(t.numel() for t in list(block.parameters()) + list(block.buffers()))
    total = sum(t.numel() for t in list(one.parameters()) + list(one.buffers()))
    return 4 * (total + len(one.parts()) * (config.depth - 1) * per)


def check_network_memory(config: ELFConfig, options: ShortRunOptions | None = None) -> None:
    """Refuse, before anything is allocated, a network whose weights alone need more memory than this process
    can still take (a mistyped --depth, --hidden, or a stored config of such numbers)."""
    what = ", ".join(f"{k} {getattr(config, k)}" for k in ("depth", "hidden", "heads", "dim", "vocab_size",
                                                               "max_length"))
    check_fits(Estimate("the network", what, {"weights": network_bytes(config, options)},
                        "choose a smaller --depth / --hidden / --length (or check the stored config)"))
