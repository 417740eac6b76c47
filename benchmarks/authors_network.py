"""A re-implementation of the authors' released ELF network (their PyTorch port), laid out as they lay it out.

This is OUR code, written from the forward semantics of their released port and its module layout, kept only
so that benchmarks can time elflow's network against the authors' structure on the same machine; elflow never
imports it. `python benchmarks/authors_network.py` checks it: it reproduces their saved outputs
(tests/reference/official_tiny.*) exactly and elflow's fp32 forward to the RoPE tables' rounding (theirs are
computed in fp32, elflow's in fp64). What it keeps from their port, because each choice decides what runs and
in which dtype under bf16 autocast:

  - the module tree and parameter names of their state dict (`text_proj.proj1`, `t_embedder.mlp_0`,
    `final_layer.norm_final`, `proj_kernel`, ...), so `elflow.official.elflow_to_official` loads into it;
  - RMSNorm: the mean of squares in fp32, 1/rms cast back to the input dtype, then `w * (x * inv_std)` in the
    input dtype (bf16 for q and k under autocast, fp32 on the residual stream);
  - RoPE as a module holding fp32 cos/sin tables of exactly prefix + max_length rows, cast to the activation
    dtype at every call; the rotation builds [-b0, a0, -b1, a1, ...] by view -> unbind -> stack -> reshape;
  - attention: qkv -> reshape (B, N, 3, nh, d) -> permute -> index [0], [1], [2], QK-norm, RoPE, SDPA with
    no upcast, permute back;
  - the input path (self-conditioning projection, bottleneck, t and omega embedders) and both heads with
    autocast disabled, i.e. in fp32; the mode tokens are gated and concatenated outside that region;
  - the decode head as (in, out) kernels, `x @ proj_kernel + proj_bias`, and the x head computed on every
    call (also in decode mode); forward returns (x_pred, logits or None).

Their code disables autocast with `torch.amp.autocast('cuda', enabled=False)`, which on a CUDA machine is the
fp32 region the semantics describe. `autocast_off="cuda"` reproduces that call literally: on a CPU it leaves
CPU autocast on, so there the input path and both heads run in bf16 as well. The default, `autocast_off=None`,
disables autocast on the tensors' own device, which is what the semantics document states.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


def _linear(n_in: int, n_out: int, bias: bool = True) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (..., d): interleaved pairs (a, b) -> (-b, a)."""
    x = x.unflatten(-1, (-1, 2))  # (..., d/2, 2)
    a, b = x.unbind(dim=-1)
    return torch.stack((-b, a), dim=-1).flatten(-2)


class TextRotaryEmbedding(nn.Module):
    """fp32 cos/sin tables for `num_empty` unrotated tokens followed by `seq_len` positions; applied to the
    whole sequence at once, so the input's length must be num_empty + seq_len."""

    def __init__(self, dim: int, seq_len: int, num_empty: int, theta: float = 10000.0):
        super().__init__()
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32)[: dim // 2] / dim))
        pos = torch.arange(seq_len, dtype=torch.float32)
        angles = torch.einsum("p,f->pf", pos, freqs).repeat_interleave(2, dim=-1)  # (L, d): f0 f0 f1 f1 ...
        cos = torch.cat([torch.ones(num_empty, dim), angles.cos()])
        sin = torch.cat([torch.zeros(num_empty, dim), angles.sin()])
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        cos, sin = self.freqs_cos.to(t.dtype), self.freqs_sin.to(t.dtype)
        return t * cos + rotate_pairs(t) * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        variance = x.float().pow(2).mean(dim=-1, keepdim=True)
        inv_std = torch.rsqrt(variance + self.eps).to(dtype)
        return self.weight.to(dtype) * (x * inv_std)


class BottleneckTextProj(nn.Module):
    def __init__(self, dim: int, hidden: int, bottleneck: int):
        super().__init__()
        self.proj1 = _linear(dim, bottleneck, bias=False)
        self.proj2 = _linear(bottleneck, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj2(self.proj1(x))


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_size: int = 256):
        super().__init__()
        self.freq_size = freq_size
        self.mlp_0 = _linear(freq_size, hidden)
        self.mlp_2 = _linear(hidden, hidden)

    @staticmethod
    def features(t: torch.Tensor, size: int, max_period: float = 10000.0) -> torch.Tensor:
        half = size // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp_2(F.silu(self.mlp_0(self.features(t, self.freq_size))))


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.hidden, self.heads = hidden, heads
        head_dim = hidden // heads
        self.qkv = _linear(hidden, 3 * hidden)
        self.q_norm = RMSNorm(head_dim)
        self.k_norm = RMSNorm(head_dim)
        self.proj = _linear(hidden, hidden)

    def forward(self, x: torch.Tensor, rope: TextRotaryEmbedding) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # (3, B, nh, N, d)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q, k = rope(self.q_norm(q)), rope(self.k_norm(k))
        x = F.scaled_dot_product_attention(q, k, v)  # (B, nh, N, d)
        return self.proj(x.permute(0, 2, 1, 3).reshape(B, N, C))


class SwiGLUFFN(nn.Module):
    def __init__(self, hidden: int, mlp_hidden: int):
        super().__init__()
        width = int(mlp_hidden * 2 / 3)
        self.w12 = _linear(hidden, 2 * width)
        self.w3 = _linear(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


class ELFBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = RMSNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.norm2 = RMSNorm(hidden)
        self.mlp = SwiGLUFFN(hidden, int(hidden * mlp_ratio))

    def forward(self, x: torch.Tensor, rope: TextRotaryEmbedding) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out: int):
        super().__init__()
        self.norm_final = RMSNorm(hidden)
        self.linear = _linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm_final(x))


class AuthorsELF(nn.Module):
    """forward(x, t, self_cond_cfg_scale, decoder_step_active=None) -> (x_pred, logits or None).

    x is [z, x_prev] (B, S, 2C) or z (B, S, C); S must equal max_length (the RoPE table has no slicing)."""

    def __init__(self, text_encoder_dim: int, max_length: int, hidden_size: int, depth: int, num_heads: int,
                 vocab_size: int, mlp_ratio: float = 4.0, bottleneck_dim: int = 128, num_time_tokens: int = 4,
                 num_self_cond_cfg_tokens: int = 4, num_model_mode_tokens: int = 4, autocast_off: str | None = None):
        super().__init__()
        self.text_encoder_dim, self.autocast_off = text_encoder_dim, autocast_off
        self.self_cond_proj = _linear(2 * text_encoder_dim, text_encoder_dim)
        self.text_proj = BottleneckTextProj(text_encoder_dim, hidden_size, bottleneck_dim)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.t_emb_tokens = nn.Parameter(torch.zeros(1, num_time_tokens, hidden_size))
        self.self_cond_cfg_embedder = TimestepEmbedder(hidden_size)
        self.self_cond_cfg_tokens = nn.Parameter(torch.zeros(1, num_self_cond_cfg_tokens, hidden_size))
        self.mode_tokens = nn.Parameter(torch.zeros(1, num_model_mode_tokens, hidden_size))
        self.num_prefix = num_time_tokens + num_self_cond_cfg_tokens + num_model_mode_tokens
        self.feat_rope = TextRotaryEmbedding(hidden_size // num_heads, max_length, self.num_prefix)
        self.blocks = nn.ModuleList(ELFBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, text_encoder_dim)
        self.proj_kernel = nn.Parameter(torch.zeros(hidden_size, text_encoder_dim))  # (in, out)
        self.proj_bias = nn.Parameter(torch.zeros(text_encoder_dim))
        self.unembed_kernel = nn.Parameter(torch.zeros(text_encoder_dim, vocab_size))  # (in, out)
        self.unembed_bias = nn.Parameter(torch.zeros(vocab_size))

    @classmethod
    def from_elflow(cls, net, autocast_off: str | None = None) -> "AuthorsELF":
        """The same weights as elflow network `net` (an ELF with the released structure)."""
        c = net.config
        ours = cls(c.dim, c.max_length, c.hidden, c.depth, c.heads, c.vocab_size, c.mlp_ratio, c.bottleneck,
                   c.time_tokens, c.omega_tokens, c.mode_tokens, autocast_off=autocast_off)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the inverse name map, a test helper
        from helpers import elflow_to_official

        ours.load_state_dict(elflow_to_official(net.state_dict()), strict=True)
        return ours.to(next(net.parameters()).device)

    def _fp32_region(self, device: torch.device):
        return torch.autocast(self.autocast_off or device.type, enabled=False)

    def forward(self, x, t, self_cond_cfg_scale, decoder_step_active=None):
        B = x.shape[0]
        with self._fp32_region(x.device):
            if x.shape[-1] == 2 * self.text_encoder_dim:
                x = self.self_cond_proj(x.float())
            x = self.text_proj(x.float())
            prefix = [self.t_emb_tokens.expand(B, -1, -1) + self.t_embedder(t).unsqueeze(1),
                      self.self_cond_cfg_tokens.expand(B, -1, -1)
                      + self.self_cond_cfg_embedder(self_cond_cfg_scale).unsqueeze(1)]
        mode = self.mode_tokens.expand(B, -1, -1)
        if decoder_step_active is None:
            gate = 0.0
        elif isinstance(decoder_step_active, torch.Tensor) and decoder_step_active.dim() > 0:
            gate = decoder_step_active.to(mode.dtype).view(-1, 1, 1)
        else:
            gate = float(decoder_step_active)
        x = torch.cat([mode * gate, x], dim=1)
        x = torch.cat([torch.cat(prefix, dim=1), x], dim=1)  # [time | omega | mode | text]
        for block in self.blocks:
            x = block(x, self.feat_rope)
        x = x[:, self.num_prefix:]
        with self._fp32_region(x.device):
            logits = None
            if decoder_step_active is not None:
                h = F.gelu(x.float() @ self.proj_kernel + self.proj_bias, approximate="tanh")
                logits = h @ self.unembed_kernel + self.unembed_bias
            out = self.final_layer(x.float())
        return out, logits


def check() -> dict:
    """Max |difference| of this network against the authors' saved outputs (tests/reference/official_tiny.*,
    their weights) and against elflow's network with the same weights (that tiny network, and ELF-B at
    L = 1,024 with elflow's initialisation), all in fp32."""
    from pathlib import Path

    from safetensors.torch import load_file

    from elflow.model import ELF, build_network, get_config
    from elflow.runs.checkpoint import load_weights
    from elflow.runs.released import infer_config, released_to_elflow

    ref = load_file(Path(__file__).resolve().parents[1] / "tests" / "reference" / "official_tiny.safetensors")
    params = {k[len("params."):]: v for k, v in ref.items() if k.startswith("params.")}
    ours = AuthorsELF(32, 16, 64, 4, 4, 100, bottleneck_dim=16).eval()
    ours.load_state_dict(params, strict=True)
    sd = released_to_elflow(params)
    net = build_network(infer_config(sd, max_length=16))
    load_weights(net, sd, "the released weights")
    net.eval()
    z, xp, t, w = ref["in.z"], ref["in.x_prev"], ref["in.t"], ref["in.w"]
    zd, td, wd = ref["in.z_decode"], ref["in.t_decode"], ref["in.w_decode"]
    gate = ref["in.decoder_step_active_mixed"]
    diff = {}
    with torch.no_grad():
        x_dec, logits = ours(torch.cat([zd, torch.zeros_like(zd)], -1), td, wd, decoder_step_active=True)
        x_mix, logits_mix = ours(torch.cat([z, xp], -1), ref["in.t_mixed"], w, decoder_step_active=gate)
        pairs = {
            "reference denoise_sc": (ours(torch.cat([z, xp], -1), t, w)[0], ref["out.denoise_sc"]),
            "reference denoise_nosc": (ours(torch.cat([z, torch.zeros_like(z)], -1), t, w)[0],
                                       ref["out.denoise_nosc"]),
            "reference denoise_plain_c": (ours(z, t, w)[0], ref["out.denoise_plain_c"]),
            "reference decode_x": (x_dec, ref["out.decode_x"]),
            "reference decode_logits": (logits, ref["out.decode_logits"]),
            "reference mixed_x": (x_mix, ref["out.mixed_x"]),
            "reference mixed_logits": (logits_mix, ref["out.mixed_logits"]),
            "reference rope cos": (ours.feat_rope.freqs_cos, ref["buffers.feat_rope.freqs_cos"]),
            "tiny: elflow denoise": (ours(torch.cat([z, xp], -1), t, w)[0], net(z, t, w, x_prev=xp)),
            "tiny: elflow decode": (logits, net.decode(zd, wd)),
        }
        torch.manual_seed(0)
        big = ELF(get_config("elf-b")).eval()
        torch.nn.init.normal_(big.x_head.weight, std=big.config.hidden ** -0.5)
        theirs = AuthorsELF.from_elflow(big).eval()
        g = torch.Generator().manual_seed(1)
        z, xp = torch.randn(1, 1024, 512, generator=g), torch.randn(1, 1024, 512, generator=g)
        t, w, one = torch.full((1,), 0.4), torch.full((1,), 3.0), torch.ones(1)
        pairs["ELF-B: elflow denoise"] = (theirs(torch.cat([z, xp], -1), t, w)[0], big(z, t, w, x_prev=xp))
        pairs["ELF-B: elflow decode"] = (theirs(torch.cat([z, torch.zeros_like(z)], -1), one, w, True)[1],
                                         big.decode(z, w))
        for name, (a, b) in pairs.items():
            diff[name] = (a - b).abs().max().item()
    return diff


if __name__ == "__main__":
    for name, d in check().items():
        print(f"{name:30s} max |diff| {d:.3e}")
