"""TODO."""

from __future__ import annotations
import math
from dataclasses import dataclass
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from elflow.util.errors import Record
from elflow.util.devices import check_memory
from elflow.space import latent_moments, token_vectors
from elflow.util.errors import ELFError


PREDICTIONS = ("x", "v", "eps")  # what the denoise head outputs


CONDITIONINGS = ("tokens", "adaln")  # how t, omega and the mode reach the blocks


DECODERS = ("shared", "separate")  # who reads out tokens: the denoiser itself, or a network of its own


class TransformerShape:
    """What every transformer config here derives from its hidden width, heads and MLP ratio."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        # SwiGLU width rule of the released configs: int(int(4H) * 2/3)
        return int(int(self.hidden * self.mlp_ratio) * 2 / 3)


@dataclass(frozen=True)
class ELFConfig(Record, TransformerShape):
    """Network shape. `dim`, `vocab_size` and `max_length` come from the embedding space and data."""

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
    predict: str = "x"  # the denoise head's target: x, v or eps (PREDICTIONS)
    conditioning: str = "tokens"  # prefix tokens, or adaLN-Zero in every block (CONDITIONINGS)
    decoder: str = "shared"  # "separate": the readout is a second network's (elflow.shortrun.SeparateDecoderELF)
    noise_scale: float = 2.0  # the training path's noise scale and clip, read by a v- or eps-predicting head
    t_eps: float = 0.05

    def __post_init__(self):
        for f in ("depth", "hidden", "heads", "dim", "vocab_size", "max_length", "bottleneck"):
            if getattr(self, f) < 1:
                raise ValueError(f"ELFConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.hidden % self.heads:
            raise ValueError(f"ELFConfig: hidden {self.hidden} is not divisible by heads {self.heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"ELFConfig: head dim {self.hidden // self.heads} must be even for RoPE pairs")
        for f, choices in (("predict", PREDICTIONS), ("conditioning", CONDITIONINGS), ("decoder", DECODERS)):
            if getattr(self, f) not in choices:
                raise ValueError(f"ELFConfig.{f} must be one of {', '.join(choices)}, got {getattr(self, f)!r}")
        if not (self.noise_scale > 0 and 0 < self.t_eps < 1):
            raise ValueError(f"ELFConfig: noise_scale must be > 0 and t_eps in (0, 1), got {self.noise_scale}, "
                             f"{self.t_eps}")

    @property
    def adaln(self) -> bool:
        return self.conditioning == "adaln"

    @property
    def num_prefix(self) -> int:
        """Tokens before the text: the time, omega and mode tokens (none under adaLN conditioning)."""
        return 0 if self.adaln else self.time_tokens + self.omega_tokens + self.mode_tokens


PRESETS: dict[str, ELFConfig] = {
    # seconds on CPU: for tests
    "tiny": ELFConfig(depth=2, hidden=64, heads=4, bottleneck=16, dim=32, vocab_size=100, max_length=32),
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


# ----------------------------------------------------------------------------------------------------------
# the prediction targets, on the path z = t x + (1 - t) noise_scale eps (t = 1 data). Each target is affine in
# x at fixed (z, t), x = a z + b out, with the coefficients clipped at t_eps at both ends (c1 = max(1 - t, t_eps)
# as in the velocity, c0 = max(t, t_eps)), so that each map is a bijection at every t:
#     x    a = 0,      b = 1
#     v    a = 1,      b = c1                       (v = (x - z) / c1)
#     eps  a = 1 / c0, b = -noise_scale c1 / c0     (eps = (z - c0 x) / (noise_scale c1))
def _affine(kind: str, t: torch.Tensor, noise_scale: float, t_eps: float):
    """(a, b) of x = a z + b out for target `kind`; t (B,) -> (B, 1, 1) each."""
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
    a, b = _affine(kind, t, noise_scale, t_eps)
    return a * z + b * out


def x_to_prediction(kind: str, x: torch.Tensor, z: torch.Tensor, t: torch.Tensor, noise_scale: float,
                    t_eps: float) -> torch.Tensor:
    """The head output of target `kind` that stands for x at (z, t): the inverse of prediction_to_x."""
    if kind == "x":
        return x
    a, b = _affine(kind, t, noise_scale, t_eps)
    return (x - a * z) / b


# ----------------------------------------------------------------------------------------------------------
# building blocks
class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps); statistics in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(length: int, head_dim: int, num_prefix: int, theta: float = 10000.0):
    """cos/sin tables (num_prefix + length, head_dim) for interleaved-pair RoPE.

    Pair (2i, 2i+1) turns with frequency theta^(-2i/d); each frequency is repeated twice [f0, f0, f1, f1, ...].
    The prefix tokens are not rotated (cos 1, sin 0); text token j (from 0) takes angle j * f_i.
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (d/2,)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * freqs[None, :]  # (L, d/2)
    angles = angles.repeat_interleave(2, dim=-1)  # (L, d)
    cos = torch.cat([torch.ones(num_prefix, head_dim, dtype=torch.float64), angles.cos()])
    sin = torch.cat([torch.zeros(num_prefix, head_dim, dtype=torch.float64), angles.sin()])
    return cos.float(), sin.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, N, d); (a, b) -> (a cos - b sin, b cos + a sin) on interleaved pairs."""
    a, b = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((-b, a), dim=-1).flatten(-2)  # (B, nh, N, d): [-b0, a0, -b1, a1, ...]
    return x * cos + rotated * sin


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
        q = apply_rope(self.q_norm(q), cos, sin).to(v.dtype)
        k = apply_rope(self.k_norm(k), cos, sin).to(v.dtype)
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
    """Pre-norm transformer block; `causal=True` gives the autoregressive variant used by the judge.

    `modulation` (B, 6H), adaLN-Zero's (shift, scale, gate) of the attention and of the MLP, modulates the
    normalised inputs of both sublayers and gates their outputs; None is the plain block."""

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
    """net(z, t, omega, x_prev=None) -> x_pred (B, L, C); net.decode(z, omega) -> logits (B, L, V);
    net.mixed(...) -> (x_pred, logits) for training batches that mix both modes.

    x_pred is the network's estimate of the clean embeddings whatever its head predicts (config.predict).
    `grad_checkpoint = True` recomputes each block in the backward pass (memory for compute); it changes no
    number and is not part of the weights."""

    def __init__(self, config: ELFConfig):
        super().__init__()
        check_size(config, ELF, _describe(config, "dim", "vocab_size", "max_length"))
        self.config = c = config
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
        self.extend_denoise_head()
        self.decode_head = DecodeHead(c.hidden, c.dim, c.vocab_size)
        cos, sin = rope_tables(c.max_length, c.head_dim, c.num_prefix, c.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def extend_denoise_head(self) -> None:
        """Where a subclass adds modules to the denoise head (elflow.shortrun); the paper's network has none.
        They are built between the two heads so that the order of the modules, and with it the random draws
        of the initialisation, is the same for every network."""

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
        if c.adaln:  # adaLN-Zero: every modulation starts at zero, every block as the identity
            for lin in (*self.block_modulation, self.final_modulation):
                nn.init.zeros_(lin.weight)
                nn.init.zeros_(lin.bias)
        nn.init.zeros_(self.x_head.weight)
        nn.init.zeros_(self.x_head.bias)

    # -- the shared trunk ----------------------------------------------------------------------------------
    def embed_time(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) flow times -> (B, H): the time embedding of the prefix tokens (or of adaLN's condition)."""
        return self.time_embed(t)

    def condition(self, t, omega, gate) -> torch.Tensor:
        """adaLN's condition c = e(t) + e(omega) + gate * mode, (B, H), in fp32."""
        dev = self.mode_embed.device
        return (self.embed_time(t.to(dev)) + self.omega_embed(omega.to(dev))
                + self.mode_embed * gate.to(dev, torch.float32)[:, None])

    def trunk(self, z, t, omega, x_prev, gate) -> torch.Tensor:
        """The transformer's output at the L text positions, (B, L, H); P = num_prefix tokens come first.

        gate (B,) float: 1 switches a row to decode mode (its mode tokens on), 0 keeps it in denoise mode.
        A network without self-conditioning (config.self_cond False) ignores x_prev.
        """
        c = self.config
        B, L, C = self._check_inputs(z, t, omega, x_prev)
        modulations = [None] * c.depth
        with torch.autocast(z.device.type, enabled=False):  # input path and prefix in fp32, as the reference
            z = z.float()
            if c.self_cond:
                x_prev = torch.zeros_like(z) if x_prev is None else x_prev.float()
                z = self.self_cond_proj(torch.cat([z, x_prev], dim=-1))
            h = self.bottleneck_out(self.bottleneck_in(z))  # (B, L, H)
            if c.adaln:
                cond = F.silu(self.condition(t, omega, gate))
                modulations = [m(cond) for m in self.block_modulation]  # (B, 6H) each
            else:
                time = self.time_tokens + self.embed_time(t.to(z.device))[:, None, :]  # (B, T, H)
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

    def modulate_head(self, h: torch.Tensor, t: torch.Tensor, omega) -> torch.Tensor:
        """The denoise head's normalised input, modulated by adaLN's condition (denoise mode); the prefix-token
        network leaves it as it is."""
        if not self.config.adaln:
            return h
        if omega is None:
            raise ValueError("an adaLN network's denoise head needs omega")
        shift, scale = self.final_modulation(F.silu(self.condition(t, omega, torch.zeros_like(t)))).chunk(2, dim=-1)
        return modulate(h, shift, scale)

    def precondition(self, out: torch.Tensor, z: torch.Tensor, t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The head's output `out` (from its input `h`) before it is read as the prediction target; the paper's
        network leaves it."""
        return out

    def denoise_head(self, h: torch.Tensor, z: torch.Tensor, t: torch.Tensor, omega=None) -> torch.Tensor:
        """x_pred (B, L, C) from the trunk's output h: RMSNorm, the head, and the head's target turned into x."""
        c = self.config
        with torch.autocast(h.device.type, enabled=False):
            h = self.modulate_head(self.final_norm(h.float()), t, omega)
            out = self.precondition(self.x_head(h), z, t, h)
            return prediction_to_x(c.predict, out, z.float(), t.to(h.device), c.noise_scale, c.t_eps)

    def logits_head(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(h.device.type, enabled=False):
            return self.decode_head(h.float())  # (B, L, V)

    def forward(self, z, t, omega, x_prev=None) -> torch.Tensor:
        """Denoise: z (B, L, C) at times t (B,) with guidance scales omega (B,) and the self-conditioning
        input x_prev (B, L, C) (None: zeros) -> the predicted clean embeddings x_pred (B, L, C)."""
        return self.denoise_head(self.trunk(z, t, omega, x_prev, z.new_zeros(z.shape[0])), z, t, omega)

    def decode(self, z, omega) -> torch.Tensor:
        """Read out tokens: the pass at t = 1 with a zero self-conditioning input and the mode tokens on.
        z (B, L, C), omega (B,) -> logits (B, L, V)."""
        ones = z.new_ones(z.shape[0])
        return self.logits_head(self.trunk(z, ones, omega, None, ones))

    def mixed(self, z, t, omega, x_prev, gate, logits_rows) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over a training batch whose rows are in either mode: gate (B,) float (1 = decode),
        logits_rows an index tensor of the rows whose logits are wanted (the decode head's).
        -> (x_pred of every row (B, L, C), logits of the chosen rows (len(logits_rows), L, V))."""
        h = self.trunk(z, t, omega, x_prev, gate)
        return self.denoise_head(h, z, t, omega), self.logits_head(h[logits_rows])

    def _check_inputs(self, z, t, omega, x_prev):
        c = self.config
        if z.dim() != 3 or z.shape[-1] != c.dim:
            raise ValueError(f"ELF: z must have shape (B, L, {c.dim}), got {tuple(z.shape)}")
        B, L, C = z.shape
        if L > c.max_length:
            raise ValueError(f"ELF: sequence length {L} exceeds this network's max_length {c.max_length}")
        for name, s in (("t", t), ("omega", omega)):
            if not isinstance(s, torch.Tensor) or s.shape != (B,):
                shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"ELF: {name} must be a tensor of shape ({B},), got {shape}")
        if x_prev is not None and x_prev.shape != z.shape:
            raise ValueError(f"ELF: x_prev must have the shape of z {tuple(z.shape)}, got {tuple(x_prev.shape)}")
        return B, L, C

    def num_params(self, exclude_decode_head: bool = False) -> int:
        """The parameters that train (frozen ones are data)."""
        n = num_params(self)
        if exclude_decode_head:
            n -= sum(p.numel() for p in self.decode_head.parameters())
        return n


# ----------------------------------------------------------------------------------------------------------
# the token-level network of the baseline methods
def num_params(module: nn.Module) -> int:
    """Trainable parameters of any network (ELF or TokenTransformer); a tied table counts once."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _describe(config, *extra) -> str:
    return ", ".join(f"{k} {getattr(config, k)}" for k in ("depth", "hidden", "heads", *extra))


def network_bytes(config, cls, *args) -> int:
    """The fp32 bytes of the weights and buffers of cls(config, *args), counted without memory: one block is
    built on the meta device and the others counted as its copies."""
    with torch.device("meta"):
        one = cls(config.replace(depth=1), *args)
        per = sum(t.numel() for t in list(one.blocks[0].parameters()) + list(one.blocks[0].buffers()))
        total = sum(t.numel() for t in list(one.parameters()) + list(one.buffers()))
    return 4 * (total + (config.depth - 1) * per)


def check_size(config, cls, what: str, *args) -> None:
    """Refuse, before anything is allocated, a network whose weights alone need more memory than this machine
    has (a mistyped --depth, --hidden, or a stored config of such numbers)."""
    if torch.get_default_device().type == "meta":  # counting (network_bytes) or built without memory
        return
    check_memory(network_bytes(config, cls, *args), f"a network of {what}",
                 hint="choose a smaller --depth / --hidden / --length (or check the stored config)")


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
