"""An autoregressive baseline over the space's tokens: next-token cross-entropy, and a cached sampler with
temperature and nucleus (top-p) sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elflow.methods.baseline import TokenMethod, draw_categorical
from elflow.methods.token_net import TokenLMConfig, TokenTransformer, fit_token_lm
from elflow.model import apply_rope
from elflow.util.budget import DOUBLE, LONG, Estimate, buffers, check_fits, merge, tensor, transformer_pass
from elflow.util.errors import ELFError


@dataclass(frozen=True)
class ARSampling:
    """temperature > 0 divides the logits; top_p in (0, 1] keeps the smallest set of ids holding that mass."""

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if not _number(self.temperature) or not self.temperature > 0:
            raise ELFError(f"AR sampling: temperature must be > 0, got {self.temperature!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ELFError(f"AR sampling: top_p must lie in (0, 1], got {self.top_p!r}")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def build(config: TokenLMConfig, space) -> TokenTransformer:
    """A causal TokenTransformer over space.vocab_size ids plus the row-start id."""
    cfg = config.replace(vocab_size=space.vocab_size)
    return TokenTransformer(cfg, causal=True, in_vocab=cfg.vocab_size + 1, out_vocab=cfg.vocab_size)


def fit_config(target: int, space, base: TokenLMConfig, **kw) -> TokenLMConfig:
    """The shape (width, depth) of an AR model with about `target` parameters (see model.fit_token_lm)."""
    V = space.vocab_size
    return fit_token_lm(target, V + 1, V, base.replace(vocab_size=V), **kw)


def bos_id(model: TokenTransformer) -> int:
    return model.config.vocab_size


def shifted_inputs(model: TokenTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """(B, L) rows -> (B, L) inputs [BOS, x_0 .. x_{L-2}]: position j reads the ids before x_j."""
    bos = torch.full_like(tokens[:, :1], bos_id(model))
    return torch.cat([bos, tokens[:, :-1]], dim=1)


def loss(model: TokenTransformer, tokens: torch.Tensor, mask: torch.Tensor | None = None,
         generator: torch.Generator | None = None):
    """Next-token cross-entropy averaged over the scored positions. Returns (loss, metrics)."""
    logits = model(shifted_inputs(model, tokens))  # (B, L, V)
    nll = F.cross_entropy(logits.float().transpose(1, 2), tokens, reduction="none")  # (B, L)
    w = torch.ones_like(nll) if mask is None else mask.to(nll.device, nll.dtype)
    n = w.sum()
    nll_sum = (nll * w).sum()
    value = nll_sum / n.clamp_min(1)
    correct = ((logits.detach().argmax(-1) == tokens).float() * w).sum()
    return value, {"loss": value.detach(), "nll_sum": nll_sum.detach(), "tokens": n, "correct": correct}


# ----------------------------------------------------------------------------------------------------------
# sampling
def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every id outside the nucleus: the most probable ids whose mass before them is below top_p (the
    most probable id is always kept). probs (..., V), normalised; returns unnormalised weights."""
    if top_p >= 1:
        return probs
    sorted_p, order = probs.sort(-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return torch.where(keep, probs, torch.zeros_like(probs))


def next_token_probs(logits: torch.Tensor, settings: ARSampling) -> torch.Tensor:
    """(..., V) logits -> float64 sampling weights after temperature and top-p."""
    probs = torch.softmax(logits.to(torch.float64) / settings.temperature, dim=-1)
    return top_p_filter(probs, settings.top_p)


def _attend_cached(attn, h, cos, sin, keys, values, pos: int):
    """Attention of the one new position `pos` (h: (B, 1, H)) over the cached positions 0..pos; writes its
    key and value into the caches (B, heads, L, head_dim). The projections are `Attention.forward`'s."""
    B, N, H = h.shape
    qkv = attn.qkv(h).view(B, N, 3, attn.heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q = apply_rope(attn.q_norm.normalize(q), cos, sin).to(keys.dtype)  # the caches' dtype (autocast may differ)
    keys[:, :, pos:pos + 1] = apply_rope(attn.k_norm.normalize(k), cos, sin)
    values[:, :, pos:pos + 1] = v
    out = F.scaled_dot_product_attention(q, keys[:, :, :pos + 1], values[:, :, :pos + 1])  # (B, nh, 1, d)
    return attn.proj(out.transpose(1, 2).reshape(B, N, H))


class _Cache:
    """Per-block key/value buffers for `length` positions; `step` runs one position through the network."""

    def __init__(self, model: TokenTransformer, batch: int, length: int, device, dtype):
        c = model.config
        if length > c.max_length:
            raise ELFError(f"cannot sample {length} positions: this network's max_length is {c.max_length}")
        self.model = model
        shape = (batch, c.heads, length, c.head_dim)
        self.kv = [(torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))
                   for _ in model.blocks]

    def step(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """ids (B,) at position `pos` -> logits (B, V) of the next id."""
        m = self.model
        h = m.embed(ids[:, None])  # (B, 1, H)
        cos, sin = m.rope_cos[pos:pos + 1], m.rope_sin[pos:pos + 1]
        for block, (keys, values) in zip(m.blocks, self.kv):
            h = h + _attend_cached(block.attn, block.norm1(h), cos, sin, keys, values, pos)
            h = h + block.mlp(block.norm2(h))
        return m.head(m.norm(h))[:, 0]


@torch.no_grad()
def cached_logits(model: TokenTransformer, inputs: torch.Tensor) -> torch.Tensor:
    """The causal forward pass one position at a time through the key/value cache: (B, N) -> (B, N, V).
    Equal to model(inputs); the sampler runs exactly these steps."""
    cache = _Cache(model, inputs.shape[0], inputs.shape[1], inputs.device, model.embed.weight.dtype)
    return torch.stack([cache.step(inputs[:, i], i) for i in range(inputs.shape[1])], dim=1)


@torch.no_grad()
def generate_tokens(model: TokenTransformer, batch: int, length: int, settings: ARSampling = ARSampling(),
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """`batch` rows of `length` ids, drawn ancestrally from BOS (see the module docstring)."""
    if batch < 1 or length < 1:
        raise ELFError(f"AR sampling needs batch and length >= 1, got {batch}, {length}")
    device = model.embed.weight.device
    c, V = model.config, model.out_vocab  # the key/value cache, a one-position pass, its logits and draw
    check_fits(Estimate("AR sampling", f"--batch {batch} --length {length}", merge(
        {"key/value cache": 2 * c.depth * tensor(batch, length, c.hidden), "ids": tensor(batch, length, element=LONG),
         "draws": buffers(*2 * [tensor(batch, V)], *4 * [tensor(batch, V, element=DOUBLE)])},
        transformer_pass(batch, 1, c.hidden, c.depth, c.heads, c.mlp_hidden, vocab=V)),
        "choose a smaller --batch or --length"), device)
    cache = _Cache(model, batch, length, device, model.embed.weight.dtype)
    out = torch.empty(batch, length, dtype=torch.long, device=device)
    current = torch.full((batch,), bos_id(model), dtype=torch.long, device=device)
    for pos in range(length):
        weights = next_token_probs(cache.step(current, pos), settings)  # (B, V) float64
        current = draw_categorical(weights, generator)
        out[:, pos] = current
    return out


class ARMethod(TokenMethod):
    name = "ar"
    title = "a token-level AR baseline"
    knobs = ("temperature", "top_p")
    sweep_axes = ("temperature",)
    sweep_fixed = ("top_p",)
    defaults = {"temperature": 1.0, "top_p": 1.0}

    network = staticmethod(build)
    fit_config = staticmethod(fit_config)
    generate_tokens = staticmethod(generate_tokens)

    def objective(self, net, tokens, batch, draw, recipe):
        return loss(net, tokens, batch.get("mask"))

    def sampler_settings(self, s):
        return ARSampling(temperature=s.temperature, top_p=s.top_p)


METHOD = ARMethod()
