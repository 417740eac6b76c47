"""A masked diffusion baseline (MDLM) over the space's tokens: the continuous-time NELBO with a linear
schedule and the ancestral sampler with the SUBS parameterisation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elflow.methods.baseline import TokenMethod, draw_categorical
from elflow.methods.token_net import TokenLMConfig, TokenTransformer, fit_token_lm
from elflow.util.budget import (
    DOUBLE,
    MAX_SAMPLING_STEPS,
    Estimate,
    buffers,
    check_count,
    check_fits,
    merge,
    tensor,
    transformer_pass,
)
from elflow.util.errors import ELFError

EPS = 1e-3  # the smallest training time: the loss weight 1/t stays below 1/EPS


@dataclass(frozen=True)
class MDLMSampling:
    """steps >= 1 reverse steps; temperature > 0 divides the logits before each draw."""

    steps: int = 64
    temperature: float = 1.0

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ELFError(f"MDLM sampling: steps must be an integer >= 1, got {self.steps!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not self.temperature > 0:
            raise ELFError(f"MDLM sampling: temperature must be > 0, got {self.temperature!r}")


def build(config: TokenLMConfig, space) -> TokenTransformer:
    """A bidirectional TokenTransformer over space.vocab_size ids plus the mask id (read-out included)."""
    cfg = config.replace(vocab_size=space.vocab_size)
    return TokenTransformer(cfg, causal=False, in_vocab=cfg.vocab_size + 1, out_vocab=cfg.vocab_size + 1)


def fit_config(target: int, space, base: TokenLMConfig, **kw) -> TokenLMConfig:
    """The shape (width, depth) of an MDLM model with about `target` parameters (see model.fit_token_lm)."""
    V = space.vocab_size
    return fit_token_lm(target, V + 1, V + 1, base.replace(vocab_size=V), **kw)


def mask_id(model: TokenTransformer) -> int:
    return model.config.vocab_size


def _subs_logits(logits: torch.Tensor, mask: int) -> torch.Tensor:
    """SUBS at a masked position: float32 logits with the mask id's logit at -inf. (Carry-over at unmasked
    positions needs no computation: the loss skips them and the sampler keeps them.)"""
    logits = logits.float()
    return logits.index_fill(-1, torch.tensor([mask], device=logits.device), float("-inf"))


def draw_times(batch: int, generator: torch.Generator | None = None, eps: float = EPS,
               low_discrepancy: bool = True, device=None) -> torch.Tensor:
    """(B,) times in [eps, 1): low-discrepancy (one uniform shifted by i / B) or independent uniforms."""
    device = device if device is not None else (generator.device if generator is not None else None)
    if low_discrepancy:
        u = torch.rand(1, generator=generator, device=device)
        u = (u + torch.arange(batch, device=device) / batch) % 1.0
    else:
        u = torch.rand(batch, generator=generator, device=device)
    return eps + (1 - eps) * u


def draw_masking(tokens: torch.Tensor, t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, L) bool: each position masked independently with probability t of its row."""
    u = torch.rand(tokens.shape, generator=generator, device=tokens.device)
    return u < t.to(tokens.device)[:, None]


def nelbo(model: TokenTransformer, tokens: torch.Tensor, t: torch.Tensor, masked: torch.Tensor,
          mask: torch.Tensor | None = None):
    """The loss for given times t (B,) and masked positions (B, L): sum over masked and scored positions of
    (1/t) (-log p(x_0 | x_t)), divided by the number of scored positions. Returns (loss, metrics).

    Only the scored masked positions are read out (the vocabulary projection is the costly part)."""
    m = mask_id(model)
    x_t = torch.where(masked, torch.full_like(tokens, m), tokens)
    scored = torch.ones_like(masked) if mask is None else mask.to(masked.device, torch.bool)
    hit = masked & scored
    rows, cols = hit.nonzero(as_tuple=True)
    h = model.features(x_t)[rows, cols]  # (n, H)
    nll = F.cross_entropy(_subs_logits(model.head(h), m), tokens[rows, cols], reduction="none")  # (n,)
    weighted = nll / t.to(nll.device)[rows]
    n = scored.sum().to(nll.dtype)
    nll_sum = weighted.sum()
    value = nll_sum / n.clamp_min(1)
    return value, {"loss": value.detach(), "nll_sum": nll_sum.detach(), "tokens": n,
                   "masked": torch.as_tensor(float(len(rows)), device=nll.device)}


def draw(tokens: torch.Tensor, generator: torch.Generator | None = None, eps: float = EPS,
         low_discrepancy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's times (B,) and masked positions (B, L), drawn from `generator` (on the tokens' device)."""
    t = draw_times(tokens.shape[0], generator, eps, low_discrepancy, device=tokens.device)
    return t, draw_masking(tokens, t, generator)


def loss(model: TokenTransformer, tokens: torch.Tensor, mask: torch.Tensor | None = None,
         generator: torch.Generator | None = None, eps: float = EPS, low_discrepancy: bool = True):
    """The NELBO of one batch with times and masks drawn from `generator`."""
    return nelbo(model, tokens, *draw(tokens, generator, eps, low_discrepancy), mask)


@torch.no_grad()
def generate_tokens(model: TokenTransformer, batch: int, length: int, settings: MDLMSampling = MDLMSampling(),
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """`batch` rows of `length` ids by ancestral unmasking from all-mask (see the module docstring)."""
    if batch < 1 or length < 1:
        raise ELFError(f"MDLM sampling needs batch and length >= 1, got {batch}, {length}")
    if length > model.config.max_length:
        raise ELFError(f"cannot sample {length} positions: this network's max_length is {model.config.max_length}")
    device = model.embed.weight.device
    check_count(settings.steps, "the MDLM sampler's steps", MAX_SAMPLING_STEPS, "it samples with 64 by default",
                hint="pass a smaller --steps")
    c, V = model.config, model.out_vocab  # a pass, its logits, and the unmasked positions' weights and CDF
    mean = batch * length / settings.steps  # positions unmasked per step, with six standard deviations to spare
    n = min(batch * length, math.ceil(mean + 6 * math.sqrt(mean) + 8))
    check_fits(Estimate("MDLM sampling", f"--batch {batch} --length {length} --steps {settings.steps}", merge(
        transformer_pass(batch, length, c.hidden, c.depth, c.heads, c.mlp_hidden, vocab=V),
        {"draws": buffers(tensor(n, V), tensor(n, V, element=DOUBLE), tensor(n, V, element=DOUBLE))}),
        "choose a smaller --batch or --length"), device)
    m = mask_id(model)
    x = torch.full((batch, length), m, dtype=torch.long, device=device)
    times = torch.linspace(1.0, 0.0, settings.steps + 1, dtype=torch.float64).tolist()
    for i in range(settings.steps):
        t, s = times[i], times[i + 1]
        u = torch.rand(batch, length, dtype=torch.float64, generator=generator, device=device)
        last = i == settings.steps - 1
        unmask = (x == m) & (True if last else u < (t - s) / t)
        rows, cols = unmask.nonzero(as_tuple=True)
        if len(rows) == 0:  # no time input: a step that unmasks nothing needs no forward pass
            continue
        logits = _subs_logits(model(x)[rows, cols], m)  # (n, V + 1), the mask id's logit -inf
        weights = torch.softmax(logits.to(torch.float64) / settings.temperature, dim=-1)
        x = x.index_put((rows, cols), draw_categorical(weights, generator))
    return x


class MDLMMethod(TokenMethod):
    name = "mdlm"
    title = "a token-level MDLM baseline"
    knobs = ("steps", "temperature")
    sweep_axes = ("steps",)
    defaults = {"steps": MDLMSampling().steps, "temperature": 1.0}

    network = staticmethod(build)
    fit_config = staticmethod(fit_config)
    generate_tokens = staticmethod(generate_tokens)

    def token_draw(self, tokens, generator):
        return draw(tokens, generator)

    def objective(self, net, tokens, batch, draw, recipe):
        return nelbo(net, tokens, *draw, batch.get("mask"))

    def sampler_settings(self, s):
        return MDLMSampling(steps=s.steps, temperature=s.temperature)


METHOD = MDLMMethod()
