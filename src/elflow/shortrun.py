"""Options for short runs: four changes to ELF's network, each off in the paper's, for runs of a few hundred
steps on a CPU (the quickstart trains with all four).

A run turns them on with `ShortRunOptions` (`short_run` in elflow.train.TrainConfig: --skip, --time-scale,
--head-modulation, --table-readout); `build_network` gives the paper's `model.ELF` when all are off and
`ShortRunELF` otherwise. A ShortRunELF holds the paper network's weights under the same names plus the
options' own tensors, and changes it only where the options act:

- `time_scale`: t is multiplied by this before its sinusoid features (DiT uses 1000; at the paper's 1 the
  features barely change over t in [0, 0.1]).
- `head_modulation`: the denoise head's input is scaled and shifted by t, as in DiT's final layer; the map is
  zero-initialised, so a fresh network is unmodulated.
- `skip="gaussian"`: x_pred = mu + g(t) (z - t mu) + s(t) head(h), the posterior mean and std of a
  per-dimension Gaussian model of the data (`gaussian_posterior`). A fresh network (zero head) is exactly that
  baseline denoiser, and the head learns what the Gaussian model misses at a scale that shrinks to 0 as t -> 1
  (EDM's preconditioning, Karras et al. 2022, with the data's own moments).
- `skip="gated"`: the same with the pass-through of z gated by the network, per position and dimension,
  x_pred = mu + (1 - a(h)) g(t) (z - t mu) + s(t) head(h), a = Linear(H, C) zero-initialised (a fresh network
  is the Gaussian skip's). The plain skip passes z's noise, g(t) (1 - t) sigma eps, into every guess, and the
  trunk sees z only through its bottleneck, so the head cannot cancel that noise in the dimensions the
  bottleneck drops, even where the network knows the data (a copied token); the sampler's final state is its
  last guess, so it keeps part of its starting noise there. The gate lets the network stop passing z where it
  predicts the data itself.
- `table_readout` = w > 0: the readout (`decode`) adds w z . R_k / sqrt(C) to the logit of every token k, R_k
  the vector the space gives token k alone (a table space's rows; Diffusion-LM's tied rounding). On a clean
  embedding the term alone reads every token exactly, rare ones included: the right row scores about
  w sqrt(C), any other about w. Training is unchanged: the training pass (`mixed`) keeps the head's own logits.

The data moments and the table R are frozen parameters, set once before training (`prepare`) and carried by
checkpoints and the EMA like any weight.

`build_network` is also where a network of `decoder="separate"` (elflow.model.ELFConfig) is assembled:
`SeparateDecoderELF`, a denoiser without a readout and a frozen decoder network of the same shape whose
decode mode reads out (the paper's Figure 5b variant, trained in two stages: elflow.train). Combinations of
the network's variants and these options that cannot work are refused here, in one place (`check_network`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from elflow.encoders import latent_moments, token_vectors
from elflow.model import ELF, ELFConfig, modulate, num_params
from elflow.official import infer_config
from elflow.utils import ELFError, Record

__all__ = ["SKIPS", "ShortRunOptions", "ShortRunELF", "SeparateDecoderELF", "build_network", "check_network",
           "stored_network", "describe_network", "network_from_state_dict", "gaussian_posterior"]

SKIPS = ("none", "gaussian", "gated")


@dataclass(frozen=True)
class ShortRunOptions(Record):
    """The four options; the defaults are the paper's network."""

    skip: str = "none"  # "gaussian": x_pred = Gaussian posterior mean + posterior std * head; "gated": its
    # pass-through of z gated by the network
    time_scale: float = 1.0  # factor on t before its sinusoid features
    head_modulation: bool = False  # the denoise head's input scaled and shifted by t
    table_readout: float = 0.0  # weight of the readout's table match

    def __post_init__(self):
        if self.skip not in SKIPS:
            raise ValueError(f"skip must be one of {', '.join(SKIPS)}, got {self.skip!r}")
        if not (isinstance(self.time_scale, (int, float)) and math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be a positive number, got {self.time_scale}")
        if not (isinstance(self.table_readout, (int, float)) and math.isfinite(self.table_readout)
                and self.table_readout >= 0):
            raise ValueError(f"table_readout must be a number >= 0, got {self.table_readout}")

    @property
    def active(self) -> bool:
        return self != ShortRunOptions()


FIELDS = tuple(ShortRunOptions().to_dict())


def gaussian_posterior(z, t, mean, var, noise_scale):
    """Posterior mean and std of x given z = t x + (1 - t) noise_scale e for x ~ N(mean, var) per dimension:
        E[x | z] = mean + g (z - t mean),  g = t var / (t^2 var + (1 - t)^2 noise_scale^2)
        Std[x | z] = (1 - t) noise_scale sqrt(var) / sqrt(t^2 var + (1 - t)^2 noise_scale^2)
    z (B, L, C), t (B,) or a number, mean / var (C,), noise_scale a number or a 0-dim tensor."""
    t = torch.as_tensor(t, dtype=torch.float32, device=z.device)
    t = t.reshape(-1, 1, 1) if t.dim() else t
    spread = (1 - t) * noise_scale
    total = t * t * var + spread * spread
    return mean + t * var / total * (z - t * mean), spread * var.sqrt() / total.sqrt()


class ShortRunELF(ELF):
    """ELF with the options of `options` (module docstring): the paper's modules and names, plus
    `head_modulation` and `skip_gate` (Linears), `skip_mean`, `skip_var`, `skip_noise` and `readout_table`
    (frozen)."""

    def __init__(self, config: ELFConfig, options: ShortRunOptions):
        self.options = options  # read by extend_denoise_head, which ELF.__init__ calls
        super().__init__(config)
        c = config
        if options.skip == "gated":  # a(h), the gate on the skip's pass-through of z, zero-initialised
            self.skip_gate = nn.utils.skip_init(nn.Linear, c.hidden, c.dim)
            nn.init.zeros_(self.skip_gate.weight)
            nn.init.zeros_(self.skip_gate.bias)
        if options.skip != "none":  # the data's moments (unit Gaussian until set) and the noise scale
            self.skip_mean = nn.Parameter(torch.zeros(c.dim), requires_grad=False)
            self.skip_var = nn.Parameter(torch.ones(c.dim), requires_grad=False)
            self.skip_noise = nn.Parameter(torch.ones(()), requires_grad=False)
        if options.table_readout:  # the space's vector for each token id (zeros until set)
            self.readout_table = nn.Parameter(torch.zeros(c.vocab_size, c.dim), requires_grad=False)

    def extend_denoise_head(self) -> None:
        if self.options.head_modulation:  # (shift, scale) of the head's input from the time embedding
            self.head_modulation = nn.Linear(self.config.hidden, 2 * self.config.hidden)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.options.head_modulation:
            nn.init.zeros_(self.head_modulation.weight)
            nn.init.zeros_(self.head_modulation.bias)
        if hasattr(self, "skip_gate"):
            nn.init.zeros_(self.skip_gate.weight)
            nn.init.zeros_(self.skip_gate.bias)

    def embed_time(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) flow times -> (B, H): the time embedding of the prefix tokens and of the head modulation."""
        return self.time_embed(t * self.options.time_scale)

    def modulate_head(self, h: torch.Tensor, t: torch.Tensor, omega) -> torch.Tensor:
        h = super().modulate_head(h, t, omega)
        if self.options.head_modulation:
            shift, scale = self.head_modulation(F.silu(self.embed_time(t.to(h.device)))).chunk(2, dim=-1)
            h = modulate(h, shift, scale)
        return h

    def precondition(self, out: torch.Tensor, z: torch.Tensor, t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if self.options.skip != "none":
            mean, std = gaussian_posterior(z.float(), t.to(z.device), self.skip_mean, self.skip_var, self.skip_noise)
            if self.options.skip == "gated":  # mu + (1 - a) g (z - t mu)
                mean = mean - self.skip_gate(h) * (mean - self.skip_mean)
            out = mean + std * out
        return out

    def table_match(self, z: torch.Tensor) -> torch.Tensor:
        """table_readout x z . R_k / sqrt(C) for every token k: (B, L, C) -> (B, L, V)."""
        with torch.autocast(z.device.type, enabled=False):
            return (z.float() @ self.readout_table.T) * (self.options.table_readout / math.sqrt(self.config.dim))

    def decode(self, z, omega) -> torch.Tensor:
        """The paper's readout, plus the table match under table_readout."""
        logits = super().decode(z, omega)
        return logits + self.table_match(z) if self.options.table_readout else logits

    @torch.no_grad()
    def set_gaussian_skip(self, mean: torch.Tensor, var: torch.Tensor, noise_scale: float) -> None:
        """Set the per-dimension data moments (C,) and the training path's noise scale of a skip="gaussian"
        or skip="gated" network."""
        if self.options.skip == "none":
            raise ValueError("set_gaussian_skip: this network was built with skip='none'")
        C = self.config.dim
        if mean.shape != (C,) or var.shape != (C,):
            raise ValueError(f"set_gaussian_skip: mean and var must have shape ({C},), got "
                             f"{tuple(mean.shape)} and {tuple(var.shape)}")
        if not (var > 0).all() or not noise_scale > 0:
            raise ValueError("set_gaussian_skip: var and noise_scale must be positive")
        self.skip_mean.copy_(mean)
        self.skip_var.copy_(var)
        self.skip_noise.fill_(float(noise_scale))

    @torch.no_grad()
    def set_readout_table(self, table: torch.Tensor) -> None:
        """Set the (vocab_size, C) token vectors of a table_readout network."""
        if not self.options.table_readout:
            raise ValueError("set_readout_table: this network was built without table_readout")
        shape = (self.config.vocab_size, self.config.dim)
        if tuple(table.shape) != shape:
            raise ValueError(f"set_readout_table: the table must have shape {shape}, got {tuple(table.shape)}")
        if not torch.isfinite(table).all():
            raise ValueError("set_readout_table: the table has non-finite entries")
        self.readout_table.copy_(table)

    def prepare(self, space, data, noise_scale: float) -> None:
        """Before training: the Gaussian skip's moments from the training split `data` (in `space`), the
        readout's table from the space's token vectors."""
        device = self.x_head.weight.device
        if self.options.skip != "none":
            self.set_gaussian_skip(*latent_moments(space, data, device=device), noise_scale)
        if self.options.table_readout:
            self.set_readout_table(token_vectors(space, self.config.vocab_size, device=device))


def options_of(options) -> ShortRunOptions:
    """A ShortRunOptions from itself, a dict of its fields, or None (all off); one-line errors."""
    if isinstance(options, ShortRunOptions):
        return options
    try:
        return ShortRunOptions.from_dict(dict(options or {}))
    except ValueError as e:
        raise ELFError(f"the short-run options do not fit together: {e}") from None


def check_network(config: ELFConfig, options: ShortRunOptions) -> None:
    """ELFError for a network variant (config) and short-run options that do not go together."""
    if options.skip != "none" and config.predict != "x":
        raise ELFError(f"--skip {options.skip} writes the head's output as a correction to the Gaussian posterior mean of "
                       f"x; it needs --predict x, not --predict {config.predict}")
    if options.head_modulation and config.adaln:
        raise ELFError("--conditioning adaln modulates the denoise head by t and omega already; pass "
                       "--head-modulation false with it")


def build_network(config: ELFConfig, options=None) -> ELF:
    """The network of `config` with the short-run `options` (a ShortRunOptions, a dict, or None): the paper's
    ELF when they are all off; a SeparateDecoderELF for config.decoder = "separate"."""
    options = options_of(options)
    check_network(config, options)
    if config.decoder == "separate":
        return SeparateDecoderELF(config, options)
    return ShortRunELF(config, options) if options.active else ELF(config)


class SeparateDecoderELF(nn.Module):
    """A denoiser and a decoder of its own (Figure 5b): two networks of config's shape, `denoiser` (its
    decode head removed, and its table readout, which only a readout uses) and `decoder` (frozen: it is
    trained first, in decode mode alone, and loaded with `load_decoder`). net(...) and net.mixed(...)
    denoise with the denoiser; net.decode(...) reads out with the decoder."""

    def __init__(self, config: ELFConfig, options: ShortRunOptions):
        super().__init__()
        part = config.replace(decoder="shared")
        self.config, self.options = config, options
        self.denoiser = build_network(part, options.replace(table_readout=0.0))
        self.denoiser.decode_head = None  # the denoiser never reads out
        self.decoder = build_network(part, options)
        self.decoder.requires_grad_(False)

    @property
    def grad_checkpoint(self) -> bool:
        return self.denoiser.grad_checkpoint

    @grad_checkpoint.setter
    def grad_checkpoint(self, value: bool) -> None:
        self.denoiser.grad_checkpoint = value

    def forward(self, z, t, omega, x_prev=None) -> torch.Tensor:
        return self.denoiser(z, t, omega, x_prev)

    def decode(self, z, omega) -> torch.Tensor:
        return self.decoder.decode(z, omega)

    def mixed(self, z, t, omega, x_prev, gate, logits_rows):
        h = self.denoiser.trunk(z, t, omega, x_prev, gate)
        return self.denoiser.denoise_head(h, z, t, omega), self.decoder.decode(z[logits_rows], omega[logits_rows])

    @torch.no_grad()
    def load_decoder(self, state_dict: dict) -> None:
        """The trained decoder's weights (a decode-only run's, elflow-named); a mismatch is a one-line error."""
        try:
            self.decoder.load_state_dict(state_dict)
        except RuntimeError as e:
            raise ELFError(f"the decoder's weights do not fit this network's decoder ({str(e).splitlines()[0][:200]})"
                           ) from None

    def prepare(self, space, data, noise_scale: float) -> None:
        for part in (self.denoiser, self.decoder):
            if hasattr(part, "prepare"):
                part.prepare(space, data, noise_scale)

    def num_params(self, exclude_decode_head: bool = False) -> int:
        """The parameters that train: the denoiser's (the frozen decoder is data)."""
        return num_params(self)


def describe_network(net: ELF) -> tuple[dict, dict]:
    """(the network's config, its short-run options; {} for the paper's network) as stored with a run."""
    options = getattr(net, "options", None)
    return net.config.to_dict(), options.to_dict() if options is not None and options.active else {}


# a stored network config may carry, besides the shape, the options and the activation checkpointing of the
# run that wrote it; they are read as options or dropped
_RUN_ONLY = ("grad_checkpoint",)


def stored_network(model: dict, short_run: dict | None = None) -> tuple[ELFConfig, ShortRunOptions]:
    """(ELFConfig, ShortRunOptions) of a stored network: its "model" config and its "short_run" options, the
    options also read from the config itself."""
    shape = {k: v for k, v in model.items() if k not in FIELDS and k not in _RUN_ONLY}
    options = {**{k: v for k, v in model.items() if k in FIELDS}, **(short_run or {})}
    try:
        return ELFConfig.from_dict(shape), options_of(options)
    except ValueError as e:
        raise ELFError(f"the stored network config cannot be read: {e}") from None


def network_from_state_dict(sd: dict[str, torch.Tensor], config: ELFConfig | None = None, options=None,
                            max_length: int = 1024, heads: int | None = None) -> ELF:
    """The network holding these (elflow-named) weights: of `config` and `options`, or of the shape inferred
    from the weights (max_length and heads as given). Weights that fit no such network are a one-line error."""
    cfg = config or infer_config(sd, max_length=max_length, heads=heads)
    net = build_network(cfg, options)
    expected = net.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise ELFError(f"weights do not fit an ELF network of shape {cfg}: missing {missing[:6]}, "
                       f"unexpected {unexpected[:6]}")
    wrong = [f"{k}: {tuple(sd[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
             if sd[k].shape != v.shape]
    if wrong:
        raise ELFError(f"weights have shapes that fit no ELF network of this shape: {wrong[:4]}")
    net.load_state_dict(sd)
    return net
