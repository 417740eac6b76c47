"""The token-level network of the baseline methods (elflow.methods.ar, .mdlm): ELF's blocks, read from and
written to token ids, and the shapes that match a parameter count (`fit_token_lm`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from elflow.model import SHAPE_DECLARED, Block, RMSNorm, TransformerShape, num_params, rope_tables
from elflow.util.budget import Estimate, check_fits
from elflow.util.errors import Record


@dataclass(frozen=True)
class TokenLMConfig(Record, TransformerShape):
    """Shape of a token-level transformer. `vocab_size` is the embedding space's tokenizer size: the methods
    add their own extra input id (AR: the row-start id, MDLM: the mask id) on top of it."""

    depth: int = 4
    hidden: int = 256
    heads: int = 4
    vocab_size: int = 30522
    max_length: int = 64  # longest sequence the RoPE table covers
    mlp_ratio: float = 4.0
    rope_theta: float = 10000.0
    tie_embeddings: bool = False  # read out with the input table (its first out_vocab rows)

    DECLARED = {**SHAPE_DECLARED, "tie_embeddings": (None, None)}

    def __post_init__(self):
        self.check_shape()
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"TokenLMConfig: hidden {self.hidden} must split into {self.heads} heads of even size")


class TokenTransformer(nn.Module):
    """ids (B, N) -> Embedding(in_vocab, H) -> depth x Block(causal) -> RMSNorm -> logits (B, N, out_vocab).

    The blocks, norms and RoPE are ELF's (RoPE on every position, no prefix). `features` and `head` split the
    forward pass so that a loss can read out only the positions it scores. Initialised as GPT-2: normal(0.02),
    residual projections scaled by 1/sqrt(2 depth), zero biases.
    """

    def __init__(self, config: TokenLMConfig, causal: bool, in_vocab: int, out_vocab: int):
        super().__init__()
        if config.tie_embeddings and out_vocab > in_vocab:
            raise ValueError(f"a tied read-out needs out_vocab <= in_vocab, got {out_vocab} > {in_vocab}")
        if torch.get_default_device().type != "meta":  # (built on meta: only counted)
            sizes = ("depth", "hidden", "heads", "vocab_size", "max_length")
            what = ", ".join(f"{k} {getattr(config, k)}" for k in sizes)
            check_fits(Estimate("the network", what, {"weights": 4 * token_lm_params(config, in_vocab, out_vocab)},
                                "choose a smaller --depth / --hidden / --length (or check the stored config)"))
        self.config = c = config
        self.causal, self.in_vocab, self.out_vocab = causal, in_vocab, out_vocab
        self.embed = nn.Embedding(in_vocab, c.hidden)
        self.blocks = nn.ModuleList(Block(c.hidden, c.heads, c.mlp_hidden, causal=causal) for _ in range(c.depth))
        self.norm = RMSNorm(c.hidden)
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.hidden, out_vocab, bias=False)
        cos, sin = rope_tables(c.max_length, c.head_dim, 0, c.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.embed.weight.is_meta:  # (on the meta device there is nothing to draw: weights are loaded next)
            self.reset_parameters()

    def reset_buffers(self) -> None:
        """The RoPE tables, which no weight file holds, made again on the weights' device (see ELF's)."""
        c = self.config
        cos, sin = rope_tables(c.max_length, c.head_dim, 0, c.rope_theta)
        self.rope_cos, self.rope_sin = (t.to(self.embed.weight.device) for t in (cos, sin))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.embed.weight, std=0.02)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=0.02)
        residual_std = 0.02 / math.sqrt(2 * self.config.depth)
        for block in self.blocks:
            for lin, std in ((block.attn.qkv, 0.02), (block.attn.proj, residual_std), (block.mlp.w12, 0.02),
                             (block.mlp.w3, residual_std)):
                nn.init.normal_(lin.weight, std=std)
                nn.init.zeros_(lin.bias)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, N) ids -> (B, N, H), the normalised stream the head reads."""
        if ids.dim() != 2:
            raise ValueError(f"TokenTransformer: ids must have shape (B, N), got {tuple(ids.shape)}")
        N = ids.shape[1]
        if N > self.config.max_length:
            raise ValueError(f"TokenTransformer: sequence length {N} exceeds max_length {self.config.max_length}")
        h = self.embed(ids)
        cos, sin = self.rope_cos[:N], self.rope_sin[:N]
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., out_vocab) logits."""
        if self.lm_head is None:
            return F.linear(h, self.embed.weight[: self.out_vocab])
        return self.lm_head(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(ids))

    def num_params(self) -> int:
        return num_params(self)


def _block_params(config: TokenLMConfig) -> int:
    with torch.device("meta"):  # built without memory, only to be counted
        return num_params(Block(config.hidden, config.heads, config.mlp_hidden))


def token_lm_params(config: TokenLMConfig, in_vocab: int, out_vocab: int, tables: bool = True) -> int:
    """The parameter count of TokenTransformer(config, ., in_vocab, out_vocab), without building it;
    `tables=False` leaves out the token tables (input embedding and untied read-out)."""
    n_tables = in_vocab * config.hidden + (0 if config.tie_embeddings else config.hidden * out_vocab)
    return n_tables * tables + config.depth * _block_params(config) + config.hidden  # + the final norm


def fit_token_lm(target: int, in_vocab: int, out_vocab: int, base: TokenLMConfig, head_dim: int | None = None,
                 tol: float = 0.03, max_depth: int = 48, max_hidden: int = 4096, tables: bool = True) -> TokenLMConfig:
    """The width and depth whose parameter count (without the token tables if not `tables`) is within `tol`
    (relative) of `target`.

    Widths are multiples of `head_dim` (default: base's), heads = width / head_dim. Among the shapes within
    `tol`, the one whose depth is closest to base.depth wins, then the closest count. Other fields (vocab,
    length, tying, MLP ratio) come from `base`. Raises ValueError when no shape is within `tol`.
    """
    head_dim = head_dim or base.head_dim
    if head_dim % 2 or target < 1:
        raise ValueError(f"fit_token_lm: need an even head_dim and a positive target, got {head_dim}, {target}")
    closest, candidates = (math.inf, None), []
    for hidden in range(head_dim, max_hidden + 1, head_dim):
        cfg = base.replace(hidden=hidden, heads=hidden // head_dim, depth=1)
        block = _block_params(cfg)
        fixed = token_lm_params(cfg, in_vocab, out_vocab, tables) - block  # tables and final norm
        for depth in range(1, max_depth + 1):
            err = abs(fixed + depth * block - target) / target
            closest = min(closest, (err, (depth, hidden)))
            if err <= tol:
                candidates.append((abs(depth - base.depth), err, depth, hidden))
    if not candidates:
        err, (depth, hidden) = closest
        raise ValueError(f"no width/depth gives {target:,} parameters within {tol:.0%} (closest: depth {depth}, "
                         f"width {hidden}, off by {err:.1%}); the token tables alone may exceed the target")
    _, _, depth, hidden = min(candidates)
    return base.replace(depth=depth, hidden=hidden, heads=hidden // head_dim)
