"""A small offline autoregressive judge: elflow's causal transformer blocks, saved as a Hugging Face causal LM.

No GPT-2 weights can be had offline, so `elflow train-judge` trains a small causal LM with the GPT-2 tokenizer
(built from the whisper BPE ranks, `elflow.gpt2_tokenizer`) and saves it as a Qwen3 causal-LM folder, which
`transformers.AutoModelForCausalLM` loads without remote code; `elflow eval --judge FOLDER` then uses it
exactly like GPT-2 Large. It is NOT GPT-2 Large: its perplexities are comparable only with each other.

    tokens -> Embedding -> depth x Block(causal=True) -> RMSNorm -> LM head (tied to the embedding)

Why Qwen3 represents `Block` exactly: pre-norm RMSNorm (eps 1e-6), q/k/v and output projections with bias
(`attention_bias`), RMSNorm over each head's q and k before RoPE (`q_norm`/`k_norm`), RoPE theta 1e4,
SwiGLU. Two differences are bridged:
  - RoPE pairs: elflow rotates interleaved pairs (2i, 2i+1), Qwen3 rotates halves (i, i + d/2) with the same
    frequency for pair i. Permuting each head's q and k rows (and q_norm/k_norm weights) by
    [0, 2, 4, ..., 1, 3, 5, ...] maps one onto the other; q.k is unchanged by a shared permutation.
  - Qwen3's MLP has no biases: the judge keeps `Block`'s SwiGLU biases at zero and frozen.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from elflow.model import Block, RMSNorm, TransformerShape, rope_tables
from elflow.utils import ELFError, Record, atomic_write_json, default_device

__all__ = ["JudgeConfig", "CausalJudge", "hf_config", "to_hf", "save_judge", "train_judge", "NOT_GPT2_NOTE"]

NOT_GPT2_NOTE = ("elflow offline judge: a small causal LM trained by `elflow train-judge`, NOT GPT-2 Large; "
                 "its generative perplexities are comparable only with each other")


@dataclass(frozen=True)
class JudgeConfig(Record, TransformerShape):
    vocab_size: int = 50257  # GPT-2
    hidden: int = 128
    depth: int = 2
    heads: int = 2
    context: int = 128  # the judge's context: `elflow eval` truncates to it
    rope_theta: float = 10000.0
    mlp_ratio: float = 4.0
    eos_id: int = 50256

    def __post_init__(self):
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ELFError(f"judge hidden {self.hidden} must split into {self.heads} heads of even size")


class CausalJudge(nn.Module):
    """Token embedding -> causal `Block`s -> RMSNorm -> tied LM head. forward: ids (B, N) -> logits (B, N, V)."""

    def __init__(self, cfg: JudgeConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg.hidden, cfg.heads, cfg.mlp_hidden, causal=True)
                                    for _ in range(cfg.depth))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.context, cfg.head_dim, 0, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._init()

    def _init(self) -> None:
        nn.init.normal_(self.embed.weight, std=0.02)
        for block in self.blocks:
            for name, lin in (("qkv", block.attn.qkv), ("proj", block.attn.proj), ("w12", block.mlp.w12),
                              ("w3", block.mlp.w3)):
                residual = name in ("proj", "w3")  # GPT-2: residual projections scaled by 1/sqrt(2 depth)
                nn.init.normal_(lin.weight, std=0.02 / (math.sqrt(2 * self.cfg.depth) if residual else 1.0))
                nn.init.zeros_(lin.bias)
            # Qwen3's MLP has no biases: keep Block's at zero so the HF model is the same function
            block.mlp.w12.bias.requires_grad_(False)
            block.mlp.w3.bias.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        N = ids.shape[1]
        if N <= self.cos.shape[0]:
            cos, sin = self.cos[:N], self.sin[:N]
        else:
            cos, sin = (t.to(ids.device) for t in rope_tables(N, self.cfg.head_dim, 0, self.cfg.rope_theta))
        h = self.embed(ids)  # (B, N, H)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.lm_head(self.norm(h))  # (B, N, V)


# ----------------------------------------------------------------------------------------------------------
# conversion to a Hugging Face Qwen3 causal LM


def hf_config(cfg: JudgeConfig):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.depth, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.context, rms_norm_eps=1e-6,
        rope_theta=cfg.rope_theta, attention_bias=True, attention_dropout=0.0, use_sliding_window=False,
        tie_word_embeddings=True, bos_token_id=cfg.eos_id, eos_token_id=cfg.eos_id, pad_token_id=cfg.eos_id,
    )


def _half_perm(head_dim: int) -> torch.Tensor:
    """Interleaved-pair order -> rotate-half order within one head: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def to_hf(judge: CausalJudge):
    """The same function as a transformers `Qwen3ForCausalLM` (fp32, eval mode)."""
    from transformers import Qwen3ForCausalLM

    cfg = judge.cfg
    H, d, M = cfg.hidden, cfg.head_dim, cfg.mlp_hidden
    perm = (torch.arange(cfg.heads)[:, None] * d + _half_perm(d)[None, :]).reshape(-1)  # rows of all heads
    sd = {"model.embed_tokens.weight": judge.embed.weight, "model.norm.weight": judge.norm.weight,
          "lm_head.weight": judge.embed.weight}
    for i, b in enumerate(judge.blocks):
        if b.mlp.w12.bias.abs().max() > 0 or b.mlp.w3.bias.abs().max() > 0:
            raise ValueError(f"judge block {i} has non-zero MLP biases, which Qwen3 cannot represent")
        p = f"model.layers.{i}."
        W, bias = b.attn.qkv.weight, b.attn.qkv.bias  # (3H, H): rows [q | k | v], each head-major
        sd.update({
            p + "input_layernorm.weight": b.norm1.weight,
            p + "post_attention_layernorm.weight": b.norm2.weight,
            p + "self_attn.q_proj.weight": W[:H][perm], p + "self_attn.q_proj.bias": bias[:H][perm],
            p + "self_attn.k_proj.weight": W[H:2 * H][perm], p + "self_attn.k_proj.bias": bias[H:2 * H][perm],
            p + "self_attn.v_proj.weight": W[2 * H:], p + "self_attn.v_proj.bias": bias[2 * H:],
            p + "self_attn.q_norm.weight": b.attn.q_norm.weight[_half_perm(d)],
            p + "self_attn.k_norm.weight": b.attn.k_norm.weight[_half_perm(d)],
            p + "self_attn.o_proj.weight": b.attn.proj.weight, p + "self_attn.o_proj.bias": b.attn.proj.bias,
            p + "mlp.gate_proj.weight": b.mlp.w12.weight[:M],  # the first half of w12 is the gate
            p + "mlp.up_proj.weight": b.mlp.w12.weight[M:],
            p + "mlp.down_proj.weight": b.mlp.w3.weight,
        })
    model = Qwen3ForCausalLM(hf_config(cfg))
    missing, unexpected = model.load_state_dict({k: v.detach().float().cpu().clone() for k, v in sd.items()},
                                                strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"Qwen3 conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def save_judge(judge: CausalJudge, tokenizer, folder: str | Path, info: dict | None = None) -> Path:
    """Write a Hugging Face causal-LM folder (config, safetensors weights, tokenizer) plus elflow_judge.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    to_hf(judge).save_pretrained(folder)
    tokenizer.model_max_length = judge.cfg.context
    tokenizer.save_pretrained(folder)
    atomic_write_json(folder / "elflow_judge.json",
                      {"note": NOT_GPT2_NOTE, "config": judge.cfg.to_dict(), **(info or {})})
    return folder


# ----------------------------------------------------------------------------------------------------------
# training


class _JudgeTokens:
    """The judge's tokenizer in the form a token store is prepared with: ids without specials, EOS appended."""

    def __init__(self, tokenizer, eos_id: int):
        from elflow.encoders import _tokenizer_fingerprint

        self.tokenizer, self.name = tokenizer, "gpt2"
        self.eos_id = self.pad_id = int(eos_id)
        self.vocab_size = len(tokenizer)
        self.tokenizer_id = _tokenizer_fingerprint(tokenizer)

    def tokenize(self, texts: list[str], eos: bool = True) -> list[list[int]]:
        ids = self.tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [row + [self.eos_id] if eos else row for row in ids]


def _corpus_ids(data: str, tokenizer, eos_id: int, cache_dir=None) -> list[torch.Tensor]:
    """The documents of `data` as ids, each ending with EOS, read from its token store (prepared once)."""
    from elflow.ingest import text_store

    store, _ = text_store(data, _JudgeTokens(tokenizer, eos_id), cache_dir)
    return [torch.from_numpy(store.record(i)[0].astype("int64")) for i in range(len(store))]


def _split_documents(docs: list, val_every: int) -> tuple[list, list]:
    """Every `val_every`-th document is held out; a single document is split 90/10 by tokens instead."""
    if len(docs) >= 2 and val_every >= 2:
        held = {i for i in range(len(docs)) if i % val_every == val_every - 1} or {len(docs) - 1}
        return ([d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held])
    stream = torch.cat(docs)
    cut = int(len(stream) * 0.9)
    return [stream[:cut]], [stream[cut:]]


def _stream(docs: list[torch.Tensor]) -> torch.Tensor:
    """The documents' ids (each ending with EOS) concatenated: (T,) long."""
    return torch.cat(docs).long() if docs else torch.zeros(0, dtype=torch.long)


@torch.no_grad()
def heldout_perplexity(judge: CausalJudge, stream: torch.Tensor, context: int, batch_size: int = 8,
                       max_windows: int | None = None) -> float:
    """exp(mean NLL) over non-overlapping `context`-token windows of the stream (every target counted)."""
    n = (len(stream) - 1) // context
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ELFError(f"the held-out text has {len(stream)} tokens, fewer than one window of {context + 1}")
    judge.eval()
    total, count = 0.0, 0
    for s in range(0, n, batch_size):
        starts = torch.arange(s, min(s + batch_size, n)) * context
        x = stream[starts[:, None] + torch.arange(context + 1)[None, :]]  # (b, context + 1)
        logits = judge(x[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum"))
        count += x[:, 1:].numel()
    return math.exp(total / count)


def train_judge(out: str | Path, cfg: JudgeConfig = JudgeConfig(), data: str = "builtin", steps: int = 200,
                batch_size: int = 8, lr: float = 3e-3, warmup: int = 30, seed: int = 0, val_every: int = 10,
                device: str | None = None, cache_dir=None, progress: bool = True,
                documents: list[str] | None = None) -> dict:
    """Train the offline judge on `data` (minus its held-out documents) and save it to `out`; returns info.
    `documents`: train on these texts instead of reading `data` (which then only names them in the info)."""
    from tqdm.auto import tqdm

    from elflow.gpt2_tokenizer import build_gpt2_tokenizer

    t0 = time.time()
    device = device or default_device()
    tokenizer = build_gpt2_tokenizer(cache_dir)
    if len(tokenizer) != cfg.vocab_size or tokenizer.eos_token_id != cfg.eos_id:
        raise ELFError(f"the tokenizer has {len(tokenizer)} tokens (EOS {tokenizer.eos_token_id}); the judge "
                       f"config expects {cfg.vocab_size} (EOS {cfg.eos_id})")
    if documents is not None:
        docs = [torch.tensor(ids) for ids in _JudgeTokens(tokenizer, cfg.eos_id).tokenize(list(documents))]
    else:
        docs = _corpus_ids(data, tokenizer, cfg.eos_id, cache_dir)
    train_docs, val_docs = _split_documents(docs, val_every)
    train_ids, val_ids = _stream(train_docs), _stream(val_docs)
    if len(train_ids) <= cfg.context + 1:
        raise ELFError(f"only {len(train_ids)} training tokens in {data!r}: need more than {cfg.context + 1}")

    torch.manual_seed(seed)
    judge = CausalJudge(cfg).to(device)
    params = [p for p in judge.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(seed)
    judge.train()
    bar = tqdm(range(steps), disable=not progress, desc="train-judge", unit="step")
    loss_ema = None
    for step in bar:
        starts = torch.randint(0, len(train_ids) - cfg.context - 1, (batch_size,), generator=gen)
        x = train_ids[starts[:, None] + torch.arange(cfg.context + 1)[None, :]].to(device)  # (B, context + 1)
        logits = judge(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        if not torch.isfinite(loss):
            raise ELFError(f"non-finite loss at step {step}; nothing was saved. Try a lower --lr")
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = loss.item()
        loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
        bar.set_postfix(loss=f"{loss_ema:.3f}")
    judge = judge.cpu()
    ppl = heldout_perplexity(judge, val_ids, cfg.context, max_windows=64)
    info = {"data": str(data), "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
            "train_tokens": len(train_ids), "heldout_tokens": len(val_ids), "heldout_documents": len(val_docs),
            "heldout_perplexity": ppl, "final_train_loss": loss_ema, "seconds": time.time() - t0}
    save_judge(judge, tokenizer, out, info)
    return info


# ----------------------------------------------------------------------------------------------------------
# command line


def add_arguments(p) -> None:
    d = JudgeConfig()
    p.add_argument("--out", default="runs/judge", help="folder for the Hugging Face causal-LM judge")
    p.add_argument("--data", default="builtin",
                   help="training text: 'builtin' (Shakespeare), a .txt file, a folder or a .jsonl file")
    p.add_argument("--steps", type=int, default=200, help="optimiser steps")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden width")
    p.add_argument("--depth", type=int, default=d.depth, help="transformer blocks")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    p.add_argument("--context", type=int, default=d.context, help="context length (eval truncates to it)")
    p.add_argument("--val-every", type=int, default=10, help="hold out every N-th document for the check")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and data order")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--cache-dir", default=None, help="where the GPT-2 ranks are cached ($ELFLOW_CACHE)")
    p.add_argument("--overwrite", action="store_true", help="write into an --out folder that is not empty")


def run(args) -> int:
    from elflow.utils import check_device, check_output

    for name in ("steps", "batch_size", "hidden", "depth", "heads"):
        if getattr(args, name) < 1:
            raise ELFError(f"--{name.replace('_', '-')} must be at least 1")
    if args.context < 2:
        raise ELFError(f"--context must be at least 2 (a judge scores each token given the ones before it), "
                       f"got {args.context}")
    if not (math.isfinite(args.lr) and args.lr > 0) or args.warmup < 0:
        raise ELFError(f"--lr must be a finite number > 0 and --warmup >= 0, got {args.lr} and {args.warmup}")
    check_device(args.device)
    out = check_output(args.out, folder=True)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise ELFError(f"--out {out} is not empty; pass --overwrite to write the judge into it (its files of the "
                       "same names are replaced), or choose another --out")
    cfg = JudgeConfig(hidden=args.hidden, depth=args.depth, heads=args.heads, context=args.context)
    info = train_judge(args.out, cfg, data=args.data, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                       warmup=args.warmup, seed=args.seed, val_every=args.val_every, device=args.device,
                       cache_dir=args.cache_dir)
    print(f"judge saved to {args.out} ({info['seconds']:.0f} s); held-out perplexity "
          f"{info['heldout_perplexity']:.2f} on {info['heldout_tokens']} tokens of {info['heldout_documents']} "
          f"held-out document(s)")
    print(f"use it with: elflow eval SAMPLES.jsonl --judge {args.out}")
    print(NOT_GPT2_NOTE)
    print(json.dumps(info))
    return 0
