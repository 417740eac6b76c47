"""ELF in one file: the network, the training step and the SDE sampler in plain PyTorch.

Embedded Language Flows: text is encoded by a frozen encoder into clean embeddings x (B, L, C); one
transformer learns to turn noise into such embeddings by x-prediction flow matching, and, switched by its
mode tokens, reads clean embeddings out as tokens. This file is where to start an idea; elflow (the library)
is where to scale it. It computes the same numbers as the library's released network, objective and sampler
(tests/project/test_nano.py checks the forward, the loss, the gradients and the samples against elflow's).

    python examples/nano_elf.py                 # trains on the built-in corpus (Shakespeare), prints samples
    python examples/nano_elf.py --steps 50      # a smoke run

Notation: t in [0, 1] (0 noise, 1 data), z_t = t x + (1 - t) s eps with s = 2, omega the guidance scale.
The frozen space and the token batches come from elflow (its built-in corpus and a random table over the
MiniLM tokenizer); the method below is plain PyTorch.
"""

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

NOISE, T_EPS = 2.0, 0.05  # the path's noise scale s, the velocity's clip
DECODE_NOISE = 5.0  # the decode branch's noise scale (1.0 for conditional tasks)


@dataclass
class Config:
    depth: int = 4
    hidden: int = 256
    heads: int = 4
    dim: int = 384  # C, the embedding size of the space
    vocab_size: int = 30522
    max_length: int = 64
    bottleneck: int = 128
    prefix: int = 4  # time, omega and mode tokens each

    @property
    def mlp_hidden(self) -> int:
        return int(int(self.hidden * 4) * 2 / 3)


# ----------------------------------------------------------------------------------------------------------
# the network


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(length: int, head_dim: int, num_prefix: int):
    """cos / sin (num_prefix + length, head_dim) of interleaved-pair RoPE; the prefix is not rotated."""
    freqs = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = (torch.arange(length, dtype=torch.float64)[:, None] * freqs).repeat_interleave(2, dim=-1)
    pad = torch.zeros(num_prefix, head_dim, dtype=torch.float64)
    return torch.cat([pad + 1, angles.cos()]).float(), torch.cat([pad, angles.sin()]).float()


def rope(x, cos, sin):
    a, b = x[..., 0::2], x[..., 1::2]
    return x * cos + torch.stack((-b, a), dim=-1).flatten(-2) * sin  # (a cos - b sin, b cos + a sin)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)

    def forward(self, h, cos, sin):
        B, N, H = h.shape
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, nh, N, d)
        q, k = rope(self.q_norm(q), cos, sin), rope(self.k_norm(k), cos, sin)
        out = F.scaled_dot_product_attention(q, k, v)  # bidirectional
        return self.proj(out.transpose(1, 2).reshape(B, N, H))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, mlp_hidden: int):
        super().__init__()
        self.w12, self.w3 = nn.Linear(hidden, 2 * mlp_hidden), nn.Linear(mlp_hidden, hidden)

    def forward(self, h):
        gate, value = self.w12(h).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * value)


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.norm1, self.attn = RMSNorm(c.hidden), Attention(c.hidden, c.heads)
        self.norm2, self.mlp = RMSNorm(c.hidden), SwiGLU(c.hidden, c.mlp_hidden)

    def forward(self, h, cos, sin):
        h = h + self.attn(self.norm1(h), cos, sin)
        return h + self.mlp(self.norm2(h))


class ScalarEmbedder(nn.Module):
    """t or omega -> 256 sinusoid features of the raw value -> Linear -> SiLU -> Linear."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(256, hidden), nn.Linear(hidden, hidden)

    def forward(self, s):
        freqs = torch.exp(-math.log(10000.0) * torch.arange(128, dtype=torch.float32, device=s.device) / 128)
        args = s.float()[:, None] * freqs
        return self.fc2(F.silu(self.fc1(torch.cat([args.cos(), args.sin()], dim=-1))))


class DecodeHead(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.proj, self.unembed = nn.Linear(c.hidden, c.dim), nn.Linear(c.dim, c.vocab_size)

    def forward(self, h):
        return self.unembed(F.gelu(self.proj(h), approximate="tanh"))


class ELF(nn.Module):
    """net(z, t, omega, x_prev) -> x_pred (B, L, C); net.decode(z, omega) -> logits (B, L, V)."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.self_cond_proj = nn.Linear(2 * c.dim, c.dim)  # [z, x_prev] -> C
        self.bottleneck_in = nn.Linear(c.dim, c.bottleneck, bias=False)
        self.bottleneck_out = nn.Linear(c.bottleneck, c.hidden)
        self.time_embed, self.omega_embed = ScalarEmbedder(c.hidden), ScalarEmbedder(c.hidden)
        self.time_tokens = nn.Parameter(torch.zeros(1, c.prefix, c.hidden))
        self.omega_tokens = nn.Parameter(torch.zeros(1, c.prefix, c.hidden))
        self.mode_tokens = nn.Parameter(torch.zeros(1, c.prefix, c.hidden))
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.final_norm, self.x_head = RMSNorm(c.hidden), nn.Linear(c.hidden, c.dim)
        self.decode_head = DecodeHead(c)
        cos, sin = rope_tables(c.max_length, c.hidden // c.heads, 3 * c.prefix)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for m in self.modules():  # xavier weights, zero biases; small prefix and embedder weights
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias) if m.bias is not None else None
        for emb in (self.time_embed, self.omega_embed):
            nn.init.normal_(emb.fc1.weight, std=0.02), nn.init.normal_(emb.fc2.weight, std=0.02)
        for tok in (self.time_tokens, self.omega_tokens, self.mode_tokens):
            nn.init.normal_(tok, std=0.02)
        nn.init.zeros_(self.x_head.weight), nn.init.zeros_(self.x_head.bias)  # a fresh net guesses x = 0

    def trunk(self, z, t, omega, x_prev, gate):
        """(B, L, H) at the text positions; gate (B,) 1 switches a row to decode mode (its mode tokens on)."""
        h = self.bottleneck_out(self.bottleneck_in(self.self_cond_proj(torch.cat([z, x_prev], dim=-1))))
        prefix = [self.time_tokens + self.time_embed(t)[:, None], self.omega_tokens + self.omega_embed(omega)[:, None],
                  self.mode_tokens * gate[:, None, None]]
        h = torch.cat([*prefix, h], dim=1)  # (B, 3P + L, H)
        n = h.shape[1]
        for block in self.blocks:
            h = block(h, self.rope_cos[:n], self.rope_sin[:n])
        return h[:, 3 * self.c.prefix:]

    def forward(self, z, t, omega, x_prev):
        return self.x_head(self.final_norm(self.trunk(z, t, omega, x_prev, torch.zeros_like(t))))

    def decode(self, z, omega):
        ones = torch.ones(z.shape[0], device=z.device)
        return self.decode_head(self.trunk(z, ones, omega, torch.zeros_like(z), ones))  # no final norm


# ----------------------------------------------------------------------------------------------------------
# training: one batch, every row in one of two branches


def draw(B: int, L: int, C: int, g: torch.Generator) -> dict:
    """The randomness of a batch: branches (decode 0.2; self-conditioning 0.5 of the rest), times
    t = sigmoid(N(-1.5, 0.8^2)), guidance log(1 + omega) ~ U[log 1.5, log 6], noise, decode levels p."""
    r = torch.rand(3, B, generator=g)
    decode = r[0] < 0.2
    t = torch.sigmoid(-1.5 + 0.8 * torch.randn(B, generator=g))
    omega = torch.exp(math.log(1.5) + torch.rand(B, generator=g) * (math.log(6) - math.log(1.5))) - 1
    return {"decode": decode, "self_cond": (r[1] < 0.5) & ~decode, "t": torch.where(decode, 1.0, t), "omega": omega,
            "eps": torch.randn(B, L, C, generator=g), "p": torch.sigmoid(0.8 + 0.8 * torch.randn(B, L, 1, generator=g))}


def elf_loss(net: ELF, x, tokens, d: dict):
    """x-prediction flow matching with self-conditioning as training-time guidance, and the decode branch:
    one token mean over both branches. x (B, L, C) clean embeddings, tokens (B, L) their ids."""
    dec, sc, omega = d["decode"], d["self_cond"], d["omega"]
    t = d["t"][:, None, None]
    clip = (1 - t).clamp_min(T_EPS)
    z = torch.where(dec[:, None, None], d["p"] * x + (1 - d["p"]) * DECODE_NOISE * d["eps"],  # decode: corrupt x
                    t * x + (1 - t) * NOISE * d["eps"])  # denoise: the flow path
    slot = torch.zeros_like(x)  # self-conditioning: on its rows, the guess of a no-grad pass with an empty slot
    with torch.no_grad():
        slot[sc] = net(z[sc], d["t"][sc], omega[sc], slot[sc])
    h = net.trunk(z, d["t"], omega, slot, dec.float())  # one pass, each row in its own mode
    x_pred = net.x_head(net.final_norm(h))  # (B, L, C)
    v, v_pred = (x - z) / clip, (x_pred - z) / clip
    v_cond, v_uncond = (x_pred.detach() - z) / clip, (slot - z) / clip
    k = torch.where(sc, 1 - 1 / omega, 0.0)[:, None, None]  # guidance on self-conditioned rows only
    err = (v_pred - (v + k * (v_cond - v_uncond))).pow(2).mean(-1)  # (B, L)
    ce = F.cross_entropy(net.decode_head(h[dec]).transpose(1, 2), tokens[dec], reduction="none")  # (Bd, L)
    return (err[~dec].sum() + ce.sum()) / tokens.numel()


# ----------------------------------------------------------------------------------------------------------
# sampling: the SDE sampler of the released code, the last step plain Euler, then one decode pass


@torch.no_grad()
def sample(net: ELF, B: int, L: int, steps: int = 32, gamma: float = 1.5, omega: float = 3.0, g=None):
    """(token ids (B, L), final z (B, L, C)). Grid: 0, sorted sigmoid(N(-1.5, 0.8^2)) draws, 1."""
    z = NOISE * torch.randn(B, L, net.c.dim, generator=g)
    grid = torch.cat([torch.zeros(1), torch.sigmoid(-1.5 + 0.8 * torch.randn(steps - 1, generator=g)).sort().values,
                      torch.ones(1)])
    w, x = torch.full((B,), omega), torch.zeros_like(z)  # x: the previous guess, the self-conditioning slot
    for i in range(steps):
        t, t_next = grid[i], grid[i + 1]
        if i < steps - 1:  # back off to t_b = alpha t with fresh noise, then Euler from t_b
            alpha = (1 - gamma * (t_next - t)).clamp(0, 1)
            z, t = alpha * z + (1 - alpha) * NOISE * torch.randn(z.shape, generator=g), alpha * t
        x = net(z, t.expand(B), w, x)
        z = z + (t_next - t) * ((x - z) / (1 - t).clamp_min(T_EPS))  # the last step lands on the guess
    return net.decode(z, w).argmax(-1), z


# ----------------------------------------------------------------------------------------------------------
# one command: train on the built-in corpus and show samples


def bounded(low: int, high: int):
    """An argparse type: an integer from low to high, else a one-line usage error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high:,}, got {value}")
        return value
    return parse


def main(argv=None):
    p = argparse.ArgumentParser(description="train a small ELF on the built-in corpus and sample from it")
    p.add_argument("--steps", type=bounded(1, 1_000_000), default=300)
    p.add_argument("--batch", type=bounded(1, 1024), default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=bounded(0, 2**31 - 1), default=0)
    args = p.parse_args(argv)
    if not 0 < args.lr < 1:
        p.error(f"--lr must be in (0, 1), got {args.lr}")
    from elflow.data.datasets import build_dataset  # the frozen space and the token rows: elflow's
    from elflow.space import build_space

    torch.manual_seed(args.seed)
    space = build_space("random-table:minilm")  # a frozen random table over MiniLM's tokenizer, x ~ N(0, 1)
    rows = build_dataset("builtin", space, 64)[0].tokens  # (N, 64) packed rows of Shakespeare
    c = Config(dim=space.dim, vocab_size=space.vocab_size)
    net = ELF(c)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        tokens = rows[torch.randint(len(rows), (args.batch,), generator=g)]
        with torch.no_grad():
            x = space.encode(tokens)
        loss = elf_loss(net, x, tokens, draw(*x.shape, g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        for group in opt.param_groups:  # linear warm-up over the first tenth
            group["lr"] = args.lr * min(1.0, step / max(1, args.steps // 10))
        opt.step()
        if step % 50 == 0 or step == args.steps:
            print(f"step {step}: loss {loss.item():.4f} ({time.time() - t0:.0f} s)")
    ids, _ = sample(net.eval(), 4, 64, g=torch.Generator().manual_seed(0))
    for text in space.decode(ids):
        print(" ", text[:160])


if __name__ == "__main__":
    main()
