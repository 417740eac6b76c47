"""The ELF network: one transformer that denoises embeddings and, in decode mode, reads them out as tokens.

Imports torch and the error type only. The released network is reproduced exactly; its variants are fields
read here alone (ELFConfig's predict / conditioning / decoder, ShortRunOptions for short runs), whose defaults
are the released network. docs/method.md reads out the layers, shapes and variants."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from elflow.util.errors import AT_LEAST_0, POSITIVE, ELFError, Record, finite

PREDICTIONS = ("x", "v", "eps")  # what the denoise head outputs
CONDITIONINGS = ("tokens", "adaln")  # how t, omega and the mode reach the blocks
DECODERS = ("shared", "separate")  # who reads out tokens: the denoiser itself, or a network of its own
SKIPS = ("none", "gaussian", "gated")  # the short-run skip of z into the guess


MAX_MLP_RATIO = 64.0  # a SwiGLU wider than 64 x the hidden width is no network anyone trains


MAX_SHAPE = 2**40  # a network's sizes (depth, width, heads, length, vocabulary): ELF-L has 32 blocks of 1,280;
# below this bound the memory check refuses what does not fit, naming the flags; past it no size is a network's


SIZE = (lambda v: 1 <= v <= MAX_SHAPE, f"from 1 to {MAX_SHAPE:,} (far past any network)")


# the fields every transformer config here shares: (range, choices), checked by Record.check_declared
SHAPE_DECLARED = {
    **{f: (SIZE, None) for f in ("depth", "hidden", "heads", "vocab_size", "max_length")},
    "mlp_ratio": ((lambda v: finite(v) and 0 < v <= MAX_MLP_RATIO, f"in (0, {MAX_MLP_RATIO:g}]"), None),
    # a base <= 1 gives every position the same angle; one past 1e30 no float table holds
    "rope_theta": ((lambda v: finite(v) and 1 < v <= 1e30, "in (1, 1e30]"), None),
}


class TransformerShape:
    """What every transformer config here derives from its hidden width, heads and MLP ratio, and the checks of
    the fields they share."""

    def check_shape(self) -> None:
        """ValueError naming the first field its declaration refuses (DECLARED, `check_declared`), or an MLP
        ratio that leaves the SwiGLU no width."""
        self.check_declared(f"{type(self).__name__}.")
        if self.mlp_hidden < 1:
            raise ValueError(f"{type(self).__name__}: mlp_ratio {self.mlp_ratio} gives a SwiGLU of no width at "
                             f"hidden {self.hidden}")

    def widened(self, max_length: int | None):
        """This config with its position table widened to `max_length` where that is longer (a stored network
        loaded for longer samples); ELFError for a length it refuses."""
        if not max_length or max_length <= self.max_length:
            return self
        try:
            return self.replace(max_length=max_length)
        except ValueError as e:
            raise ELFError(f"max_length {max_length}: {e}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        # SwiGLU width rule of the released configs: int(int(4H) * 2/3)
        return int(int(self.hidden * self.mlp_ratio) * 2 / 3)


@dataclass(frozen=True)
class ELFConfig(Record, TransformerShape):
    """Network shape and variant (`dim`, `vocab_size`, `max_length` from the space and data); the training path's
    `noise_scale` and `t_eps` are read by a v- or eps-predicting head alone (None for the x head)."""

    depth: int = 12
    hidden: int = 768
    heads: int = 12
    dim: int = 512  # encoder output dimension C
    vocab_size: int = 32100
    max_length: int = 1024  # longest sequence the RoPE table covers; any L <= max_length works
    bottleneck: int = 128
    mlp_ratio: float = 4.0
    time_tokens: int = 4
    omega_tokens: int = 4
    mode_tokens: int = 4
    rope_theta: float = 10000.0
    self_cond: bool = True  # input is [z, x_prev]; False for networks trained with self_cond_prob = 0
    predict: str = "x"  # the denoise head's target (PREDICTIONS)
    conditioning: str = "tokens"  # prefix tokens, or adaLN-Zero in every block (CONDITIONINGS)
    decoder: str = "shared"  # "separate": the readout is a second network's (SeparateDecoderELF)
    target_time: bool = False  # a flow map: the time t' it jumps to enters beside t (elflow.methods.flowmap)
    noise_scale: float | None = None
    t_eps: float | None = None

    DECLARED = {**SHAPE_DECLARED, "dim": (SIZE, None), "bottleneck": (SIZE, None),
                **{f: (AT_LEAST_0, None) for f in ("time_tokens", "omega_tokens", "mode_tokens")},
                "self_cond": (None, None), "target_time": (None, None), "predict": (None, PREDICTIONS),
                "conditioning": (None, CONDITIONINGS), "decoder": (None, DECODERS)}

    def __post_init__(self):
        self.check_shape()
        if self.hidden % self.heads:
            raise ValueError(f"ELFConfig: hidden {self.hidden} is not divisible by heads {self.heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"ELFConfig: head dim {self.hidden // self.heads} must be even for RoPE pairs")
        if self.predict == "x":  # nothing reads them: stored configs that carry them compare equal
            object.__setattr__(self, "noise_scale", None)
            object.__setattr__(self, "t_eps", None)
        elif not (self.noise_scale is not None and self.noise_scale > 0 and self.t_eps is not None
                  and 0 < self.t_eps < 1):
            raise ValueError(f"ELFConfig: a {self.predict}-predicting head needs the path's noise_scale > 0 and "
                             f"t_eps in (0, 1), got {self.noise_scale}, {self.t_eps}")

    @property
    def adaln(self) -> bool:
        return self.conditioning == "adaln"

    @property
    def separate_decoder(self) -> bool:
        return self.decoder == "separate"

    @property
    def num_prefix(self) -> int:
        """Tokens before the text: the time, omega and mode tokens (none under adaLN conditioning)."""
        return 0 if self.adaln else self.time_tokens + self.omega_tokens + self.mode_tokens


# network sizes by name (--preset); the run presets of a whole run are elflow.config.RUN_DEFAULTS (--defaults)
PRESETS: dict[str, ELFConfig] = {
    "tiny": ELFConfig(depth=2, hidden=64, heads=4, bottleneck=16, dim=32, vocab_size=100, max_length=32),  # tests
    # the offline quick-start: MiniLM-L6 space (384 dims, BERT vocabulary), L = 64, minutes on a laptop CPU
    "demo": ELFConfig(depth=4, hidden=256, heads=4, bottleneck=128, dim=384, vocab_size=30522, max_length=64),
    # the paper's sizes (T5-small space: 512 dims, vocabulary 32,100, L = 1024)
    "elf-b": ELFConfig(depth=12, hidden=768, heads=12),
    "elf-m": ELFConfig(depth=24, hidden=1056, heads=16),
    "elf-l": ELFConfig(depth=32, hidden=1280, heads=16),
}


def get_config(name: str, **overrides) -> ELFConfig:
    """A preset by name, with field overrides (e.g. dim/vocab_size from the embedding space)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].replace(**{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class ShortRunOptions(Record):
    """Four changes for short runs (docs/method.md), the defaults the paper's network: t scaled before its
    features, the head's input modulated by t, a Gaussian (or gated) skip of z, a readout helped by a table."""

    skip: str = "none"
    time_scale: float = 1.0
    head_modulation: bool = False
    table_readout: float = 0.0

    DECLARED = {"skip": (None, SKIPS), "time_scale": (POSITIVE, None), "head_modulation": (None, None),
                "table_readout": (AT_LEAST_0, None)}

    def __post_init__(self):
        self.check_declared()

    @property
    def active(self) -> bool:
        return self != ShortRunOptions()


def options_of(options) -> ShortRunOptions:
    """A ShortRunOptions from itself, a dict of its fields, or None (all off); one-line errors."""
    if isinstance(options, ShortRunOptions):
        return options
    try:
        return ShortRunOptions.from_dict(dict(options or {}))
    except ValueError as e:
        raise ELFError(f"the short-run options do not fit together: {e}") from None


def check_network(predict: str, conditioning: str, options: ShortRunOptions) -> None:
    """ELFError for a network variant and short-run options that do not go together."""
    if options.skip != "none" and predict != "x":
        raise ELFError(f"--skip {options.skip} writes the head's output as a correction to the Gaussian posterior "
                       f"mean of x; it needs --predict x, not --predict {predict}")
    if options.head_modulation and conditioning == "adaln":
        raise ELFError("--conditioning adaln modulates the denoise head by t and omega already; pass "
                       "--head-modulation false with it")


def build_network(config: ELFConfig, options=None):
    """The network of `config` and the short-run `options` (a ShortRunOptions, a dict or None): an ELF, or a
    SeparateDecoderELF for config.decoder "separate". The one place where a variant picks a class."""
    options = options_of(options)
    check_network(config.predict, config.conditioning, options)
    return SeparateDecoderELF(config, options) if config.separate_decoder else ELF(config, options)


# ----------------------------------------------------------------------------------------------------------
# the prediction targets on the path z = t x + (1 - t) noise_scale eps: x = a z + b out (docs/method.md)
def prediction_affine(kind: str, t: torch.Tensor, noise_scale: float, t_eps: float):
    """(a, b) of x = a z + b out for target `kind`, clipped at t_eps at both ends; t (B,) -> (B, 1, 1) each."""
    t = t.float().reshape(-1, 1, 1)
    c0, c1 = t.clamp_min(t_eps), (1 - t).clamp_min(t_eps)
    if kind == "x":
        return torch.zeros_like(t), torch.ones_like(t)
    if kind == "v":
        return torch.ones_like(t), c1
    if kind == "eps":
        return 1 / c0, -noise_scale * c1 / c0
    raise ValueError(f"unknown prediction target {kind!r}; choose one of {', '.join(PREDICTIONS)}")


def prediction_to_x(kind: str, out: torch.Tensor, z: torch.Tensor, t: torch.Tensor, noise_scale: float,
                    t_eps: float) -> torch.Tensor:
    """The x that a head output `out` of target `kind` (x, v or eps) stands for at (z, t); t (B,)."""
    if kind == "x":
        return out
    a, b = prediction_affine(kind, t, noise_scale, t_eps)
    return a * z + b * out


def gaussian_posterior(z, t, mean, var, noise_scale):
    """Posterior mean and std of x given z = t x + (1 - t) noise_scale e for x ~ N(mean, var) per dimension
    (docs/method.md): z (B, L, C), t (B,) or a number, mean / var (C,), noise_scale a number or 0-dim tensor."""
    t = torch.as_tensor(t, dtype=torch.float32, device=z.device)
    t = t.reshape(-1, 1, 1) if t.dim() else t
    spread = (1 - t) * noise_scale
    total = t * t * var + spread * spread
    return mean + t * var / total * (z - t * mean), spread * var.sqrt() / total.sqrt()


# ----------------------------------------------------------------------------------------------------------
# building blocks
class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps); statistics in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x).to(x.dtype)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:  # in fp32, before `forward` casts it back
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


def rope_tables(length: int, head_dim: int, num_prefix: int, theta: float = 10000.0):
    """cos/sin tables (num_prefix + length, head_dim) for interleaved-pair RoPE: pair (2i, 2i+1) of text token j
    turns by j theta^(-2i/d); the prefix tokens are not rotated (cos 1, sin 0). Under the meta device (a network
    counted, or built to be loaded: `ELF.reset_buffers` makes them then) they are empty tensors of their shape:
    the meta device's arange goes through torch's reference kernels, whose first use imports torch._dynamo."""
    if torch.empty(0).is_meta:
        return torch.empty(num_prefix + length, head_dim), torch.empty(num_prefix + length, head_dim)
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (d/2,)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * freqs[None, :]  # (L, d/2)
    angles = angles.repeat_interleave(2, dim=-1)  # (L, d)
    cos = torch.cat([torch.ones(num_prefix, head_dim, dtype=torch.float64), angles.cos()])
    sin = torch.cat([torch.zeros(num_prefix, head_dim, dtype=torch.float64), angles.sin()])
    return cos.float(), sin.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, N, d); (a, b) -> (a cos - b sin, b cos + a sin) on interleaved pairs, in fp32 (or wider)."""
    x = x.to(torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32))
    if torch.compiler.is_compiling() or x.requires_grad:  # the real form: the compiler fuses it (it emits no
        a, b = x[..., 0::2], x[..., 1::2]  # complex code), and its gradient is the same in eager and compiled runs
        return x * cos + torch.stack((-b, a), dim=-1).flatten(-2) * sin  # [-b0, a0, -b1, a1, ...]
    # inference, eager: one complex product (a + ib)(cos + i sin) per pair, one pass over x instead of five
    turn = torch.complex(cos[..., 0::2].to(x.dtype), sin[..., 0::2].to(x.dtype))  # (N, d/2)
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * turn).flatten(-2)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.causal = heads, hidden // heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=True)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)
        self.proj = nn.Linear(hidden, hidden, bias=True)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, N, H = h.shape
        qkv = self.qkv(h).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, nh, N, d)
        q, k, v = qkv.unbind(0)
        q = apply_rope(self.q_norm.normalize(q), cos, sin).to(v.dtype)  # QK-norm and RoPE in fp32, rounded once
        k = apply_rope(self.k_norm.normalize(k), cos, sin).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, nh, N, d)
        return self.proj(out.transpose(1, 2).reshape(B, N, H))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, mlp_hidden: int):
        super().__init__()
        self.w12 = nn.Linear(hidden, 2 * mlp_hidden, bias=True)
        self.w3 = nn.Linear(mlp_hidden, hidden, bias=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, value = self.w12(h).chunk(2, dim=-1)  # first half is the gate
        return self.w3(F.silu(gate) * value)


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """h (B, N, H) scaled by 1 + scale and shifted by shift, both (B, H): DiT's modulation."""
    return h * (1 + scale[:, None, :]) + shift[:, None, :]


class Block(nn.Module):
    """Pre-norm transformer block (`causal`: the judge's). `modulation` (B, 6H): adaLN-Zero's (shift, scale,
    gate) of both sublayers; None is the plain block."""

    def __init__(self, hidden: int, heads: int, mlp_hidden: int, causal: bool = False):
        super().__init__()
        self.norm1 = RMSNorm(hidden)
        self.attn = Attention(hidden, heads, causal=causal)
        self.norm2 = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, mlp_hidden)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                modulation: torch.Tensor | None = None) -> torch.Tensor:
        if modulation is None:
            h = h + self.attn(self.norm1(h), cos, sin)
            return h + self.mlp(self.norm2(h))
        shift1, scale1, gate1, shift2, scale2, gate2 = modulation.to(h.dtype).chunk(6, dim=-1)
        h = h + gate1[:, None, :] * self.attn(modulate(self.norm1(h), shift1, scale1), cos, sin)
        return h + gate2[:, None, :] * self.mlp(modulate(self.norm2(h), shift2, scale2))


def timestep_features(t: torch.Tensor, size: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """(B,) -> (B, size): [cos(t f_k), sin(t f_k)], f_k = exp(-ln(max_period) k / (size/2)); t not rescaled."""
    half = size // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ScalarEmbedder(nn.Module):
    """A scalar (t or omega) -> sinusoid features -> Linear -> SiLU -> Linear."""

    def __init__(self, hidden: int, freq_size: int = 256):
        super().__init__()
        self.freq_size = freq_size
        self.fc1 = nn.Linear(freq_size, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(timestep_features(s, self.freq_size))))


class DecodeHead(nn.Module):
    """Token readout on the un-normalised residual stream: Linear(H, C) -> GELU(tanh) -> Linear(C, V)."""

    def __init__(self, hidden: int, dim: int, vocab_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden, dim)
        self.unembed = nn.Linear(dim, vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.unembed(F.gelu(self.proj(h), approximate="tanh"))


# ----------------------------------------------------------------------------------------------------------
# the network


class ELF(nn.Module):
    """net(z, t, omega, x_prev=None) -> x_pred (B, L, C), the clean embeddings whatever the head predicts;
    net.decode(z, omega) -> logits (B, L, V); net.mixed(...) -> both, for a batch whose rows are in either mode.
    `grad_checkpoint = True` recomputes each block in the backward pass (no number changes). The short-run
    options' data (the skip's moments, the readout's table) are frozen parameters set before training."""

    def __init__(self, config: ELFConfig, options: ShortRunOptions | None = None):
        super().__init__()
        self.config = c = config
        self.options = o = options or ShortRunOptions()
        self.grad_checkpoint = False
        if c.self_cond:
            self.self_cond_proj = nn.Linear(2 * c.dim, c.dim)
        self.bottleneck_in = nn.Linear(c.dim, c.bottleneck, bias=False)
        self.bottleneck_out = nn.Linear(c.bottleneck, c.hidden)
        self.time_embed = ScalarEmbedder(c.hidden)
        self.omega_embed = ScalarEmbedder(c.hidden)
        if c.adaln:  # the mode's vector in the condition c; one zero-initialised modulation map per block
            self.mode_embed = nn.Parameter(torch.zeros(1, c.hidden))
            self.block_modulation = nn.ModuleList(nn.Linear(c.hidden, 6 * c.hidden) for _ in range(c.depth))
        else:
            self.time_tokens = nn.Parameter(torch.zeros(1, c.time_tokens, c.hidden))
            self.omega_tokens = nn.Parameter(torch.zeros(1, c.omega_tokens, c.hidden))
            self.mode_tokens = nn.Parameter(torch.zeros(1, c.mode_tokens, c.hidden))
        self.blocks = nn.ModuleList(Block(c.hidden, c.heads, c.mlp_hidden) for _ in range(c.depth))
        self.final_norm = RMSNorm(c.hidden)
        self.x_head = nn.Linear(c.hidden, c.dim)
        if c.adaln:  # DiT's final layer: the head's input scaled and shifted by c
            self.final_modulation = nn.Linear(c.hidden, 2 * c.hidden)
        if o.head_modulation:  # (shift, scale) of the head's input from the time embedding
            self.head_modulation = nn.Linear(c.hidden, 2 * c.hidden)
        self.decode_head = DecodeHead(c.hidden, c.dim, c.vocab_size)
        cos, sin = rope_tables(c.max_length, c.head_dim, c.num_prefix, c.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.x_head.weight.is_meta:  # (on the meta device there is nothing to draw: weights are loaded next)
            self.reset_parameters()
        # built after the initialisation draws, so that every network draws the same initial weights
        if o.skip == "gated":  # a(h), the gate on the skip's pass-through of z, zero-initialised
            self.skip_gate = nn.utils.skip_init(nn.Linear, c.hidden, c.dim)
            nn.init.zeros_(self.skip_gate.weight)
            nn.init.zeros_(self.skip_gate.bias)
        if o.skip != "none":  # the data's moments (unit Gaussian until set) and the noise scale
            self.skip_mean = nn.Parameter(torch.zeros(c.dim), requires_grad=False)
            self.skip_var = nn.Parameter(torch.ones(c.dim), requires_grad=False)
            self.skip_noise = nn.Parameter(torch.ones(()), requires_grad=False)
        if o.table_readout:  # the space's vector for each token id (zeros until set)
            self.readout_table = nn.Parameter(torch.zeros(c.vocab_size, c.dim), requires_grad=False)
        if c.target_time:  # the embedding of the target time, added to t's: zero at first, the network its teacher
            self.target_embed = ScalarEmbedder(c.hidden)
            nn.init.normal_(self.target_embed.fc1.weight, std=0.02)
            for p in (self.target_embed.fc1.bias, self.target_embed.fc2.weight, self.target_embed.fc2.bias):
                nn.init.zeros_(p)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        c = self.config
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        for emb in (self.time_embed, self.omega_embed):
            for lin in (emb.fc1, emb.fc2):
                nn.init.normal_(lin.weight, std=0.02)
                nn.init.zeros_(lin.bias)
        for tok in (self.mode_embed,) if c.adaln else (self.time_tokens, self.omega_tokens, self.mode_tokens):
            nn.init.normal_(tok, std=0.02)
        zeroed = [self.x_head]
        if c.adaln:  # adaLN-Zero: every modulation starts at zero, every block as the identity
            zeroed += [*self.block_modulation, self.final_modulation]
        zeroed += [getattr(self, name) for name in ("head_modulation", "skip_gate") if hasattr(self, name)]
        for lin in zeroed:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    # -- the shared trunk ----------------------------------------------------------------------------------
    def embed_time(self, t: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) flow times -> (B, H): the time embedding of the prefix tokens (or of adaLN's condition); a flow
        map's adds the embedding of the target time it jumps to (`target`, (B,); None: t itself)."""
        e = self.time_embed(t * self.options.time_scale)
        if self.config.target_time:
            e = e + self.target_embed((t if target is None else target.to(t.device)) * self.options.time_scale)
        return e

    def condition(self, t, omega, gate, target=None) -> torch.Tensor:
        """adaLN's condition c = e(t) + e(omega) + gate * mode, (B, H), in fp32."""
        dev = self.mode_embed.device
        return (self.embed_time(t.to(dev), target) + self.omega_embed(omega.to(dev))
                + self.mode_embed * gate.to(dev, torch.float32)[:, None])

    def trunk(self, z, t, omega, x_prev, gate, target=None) -> torch.Tensor:
        """The transformer's output at the L text positions, (B, L, H); P = num_prefix tokens come first.

        gate (B,) float: 1 switches a row to decode mode (its mode tokens on), 0 keeps it in denoise mode.
        A network without self-conditioning (config.self_cond False) ignores x_prev. `target` (B,): the time a
        flow map jumps to (config.target_time; None: t, the instantaneous guess); other networks refuse it.
        """
        c = self.config
        B, L, C = self._check_inputs(z, t, omega, x_prev, target)
        modulations = [None] * c.depth
        with torch.autocast(z.device.type, enabled=False):  # input path and prefix in fp32, as the reference
            z = z.float()
            if c.self_cond:
                x_prev = torch.zeros_like(z) if x_prev is None else x_prev.float()
                z = self.self_cond_proj(torch.cat([z, x_prev], dim=-1))
            h = self.bottleneck_out(self.bottleneck_in(z))  # (B, L, H)
            if c.adaln:
                cond = F.silu(self.condition(t, omega, gate, target))
                modulations = [m(cond) for m in self.block_modulation]  # (B, 6H) each
            else:
                time = self.time_tokens + self.embed_time(t.to(z.device), target)[:, None, :]  # (B, T, H)
                om = self.omega_tokens + self.omega_embed(omega.to(z.device))[:, None, :]  # (B, W, H)
                mode = self.mode_tokens * gate.to(z.device, torch.float32)[:, None, None]  # zeros in denoise mode
                h = torch.cat([time, om, mode, h], dim=1)  # (B, P + L, H)
        n = c.num_prefix + L
        cos, sin = self.rope_cos[:n], self.rope_sin[:n]
        for block, mod in zip(self.blocks, modulations):
            args = (h, cos, sin) if mod is None else (h, cos, sin, mod)
            if self.grad_checkpoint and self.training and torch.is_grad_enabled():
                h = checkpoint(block, *args, use_reentrant=False)
            else:
                h = block(*args)
        return h[:, c.num_prefix:]  # drop the prefix: (B, L, H)

    # -- the heads -----------------------------------------------------------------------------------------
    def denoise_head(self, h: torch.Tensor, z: torch.Tensor, t: torch.Tensor, omega=None, target=None) -> torch.Tensor:
        """x_pred (B, L, C) from the trunk's output h: RMSNorm, the modulations of the variant, the head, the
        Gaussian skip, and the head's target turned into x."""
        c, o = self.config, self.options
        with torch.autocast(h.device.type, enabled=False):
            h = self.final_norm(h.float())
            if c.adaln:
                if omega is None:
                    raise ValueError("an adaLN network's denoise head needs omega")
                cond = F.silu(self.condition(t, omega, torch.zeros_like(t), target))
                h = modulate(h, *self.final_modulation(cond).chunk(2, dim=-1))
            if o.head_modulation:
                e = self.embed_time(t.to(h.device), target)
                h = modulate(h, *self.head_modulation(F.silu(e)).chunk(2, dim=-1))
            out = self.x_head(h)
            if o.skip != "none":
                mean, std = gaussian_posterior(z.float(), t.to(z.device), self.skip_mean, self.skip_var,
                                               self.skip_noise)
                if o.skip == "gated":  # mu + (1 - a) g (z - t mu)
                    mean = mean - self.skip_gate(h) * (mean - self.skip_mean)
                out = mean + std * out
            return prediction_to_x(c.predict, out, z.float(), t.to(h.device), c.noise_scale, c.t_eps)

    def reset_buffers(self) -> None:
        """The RoPE tables, which no weight file holds, made again on the weights' device (a network built on
        the meta device and then given its stored weights: elflow.runs.checkpoint.load_weights)."""
        c = self.config
        cos, sin = rope_tables(c.max_length, c.head_dim, c.num_prefix, c.rope_theta)
        self.rope_cos, self.rope_sin = (t.to(self.x_head.weight.device) for t in (cos, sin))

    def logits_head(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(h.device.type, enabled=False):
            return self.decode_head(h.float())  # (B, L, V)
    # -- the three passes ----------------------------------------------------------------------------------
    def forward(self, z, t, omega, x_prev=None, target=None) -> torch.Tensor:
        """Denoise: z (B, L, C) at times t (B,) with guidance scales omega (B,) and the self-conditioning
        input x_prev (B, L, C) (None: zeros) -> the predicted clean embeddings x_pred (B, L, C). A flow map
        (config.target_time) takes the time it jumps to, `target` (B,): its guess x_hat, whose jump lands at
        z + (target - t)(x_hat - z) / max(1 - t, t_eps) (elflow.flow.euler_step)."""
        h = self.trunk(z, t, omega, x_prev, z.new_zeros(z.shape[0]), target)
        return self.denoise_head(h, z, t, omega, target)

    def decode(self, z, omega) -> torch.Tensor:
        """Read out tokens: the pass at t = 1 with a zero self-conditioning input and the mode tokens on (plus
        the table match under table_readout). z (B, L, C), omega (B,) -> logits (B, L, V)."""
        ones = z.new_ones(z.shape[0])
        logits = self.logits_head(self.trunk(z, ones, omega, None, ones))
        if self.options.table_readout:  # + w z . R_k / sqrt(C) for every token k
            with torch.autocast(z.device.type, enabled=False):
                w = self.options.table_readout / math.sqrt(self.config.dim)
                logits = logits + (z.float() @ self.readout_table.T) * w
        return logits

    def mixed(self, z, t, omega, x_prev, gate, logits_rows) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over a training batch whose rows are in either mode: gate (B,) float (1 = decode),
        logits_rows an index tensor of the rows whose logits are wanted (the decode head's).
        -> (x_pred of every row (B, L, C), logits of the chosen rows (len(logits_rows), L, V))."""
        h = self.trunk(z, t, omega, x_prev, gate)
        return self.denoise_head(h, z, t, omega), self.logits_head(h[logits_rows])

    def _check_inputs(self, z, t, omega, x_prev, target=None):
        c = self.config
        if z.dim() != 3 or z.shape[-1] != c.dim:
            raise ValueError(f"ELF: z must have shape (B, L, {c.dim}), got {tuple(z.shape)}")
        if z.shape[1] > c.max_length:
            raise ValueError(f"ELF: sequence length {z.shape[1]} exceeds this network's max_length {c.max_length}")
        B = z.shape[0]
        for name, s in (("t", t), ("omega", omega)):
            if not isinstance(s, torch.Tensor) or s.shape != (B,):
                shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"ELF: {name} must be a tensor of shape ({B},), got {shape}")
        if target is not None and not c.target_time:
            raise ValueError("ELF: a target time is given to a network that takes none (config.target_time False)")
        if target is not None and (not isinstance(target, torch.Tensor) or target.shape != (B,)):
            raise ValueError(f"ELF: target must be a tensor of shape ({B},)")
        if x_prev is not None and x_prev.shape != z.shape:
            raise ValueError(f"ELF: x_prev must have the shape of z {tuple(z.shape)}, got {tuple(x_prev.shape)}")
        return z.shape

    # -- the short-run options' data -----------------------------------------------------------------------
    @torch.no_grad()
    def set_gaussian_skip(self, mean: torch.Tensor, var: torch.Tensor, noise_scale: float) -> None:
        """Set the per-dimension data moments (C,) and the training path's noise scale of a skip network."""
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

    def parts(self) -> list["ELF"]:  # the ELF networks this network is made of
        return [self]

    def num_params(self, exclude_decode_head: bool = False) -> int:
        """The parameters that train (frozen ones are data)."""
        n = num_params(self)
        if exclude_decode_head:
            n -= sum(p.numel() for p in self.decode_head.parameters())
        return n


class SeparateDecoderELF(nn.Module):
    """A denoiser and a decoder of its own (the paper's Figure 5b): two ELF networks of config's shape,
    `denoiser` (without a readout) and `decoder` (frozen: trained first, in decode mode alone, and loaded with
    `load_decoder`). net(...) and net.mixed(...) denoise with the denoiser; net.decode(...) reads out with the
    decoder."""

    def __init__(self, config: ELFConfig, options: ShortRunOptions):
        super().__init__()
        part = config.replace(decoder="shared")
        self.config, self.options = config, options
        self.denoiser = ELF(part, options.replace(table_readout=0.0))  # the readout's table is the decoder's
        self.denoiser.decode_head = None  # the denoiser never reads out
        self.decoder = ELF(part, options)
        self.decoder.requires_grad_(False)

    grad_checkpoint = property(lambda self: self.denoiser.grad_checkpoint,
                               lambda self, on: setattr(self.denoiser, "grad_checkpoint", on))

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

    def parts(self) -> list[ELF]:
        return [self.denoiser, self.decoder]

    def num_params(self, exclude_decode_head: bool = False) -> int:
        return num_params(self)  # the denoiser's: the frozen decoder is data


def num_params(module: nn.Module) -> int:
    """Trainable parameters of any network; a tied table counts once."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
