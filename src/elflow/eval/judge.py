"""Judges: loading a causal LM (GPT-2 Large, or any folder) to score texts, and training a small offline one
with GPT-2's tokenizer, saved as a Hugging Face causal LM (it is not GPT-2 Large: its figures compare only
with each other)."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from elflow.data.datasets import text_store
from elflow.encoders import tokenizer_fingerprint
from elflow.eval.gpt2_tokenizer import build_gpt2_tokenizer
from elflow.eval.metrics import DTYPES
from elflow.model import Block, RMSNorm, TransformerShape, rope_tables
from elflow.util.budget import (
    MAX_TRAINING_STEPS,
    Estimate,
    block_params,
    check_count,
    check_fits,
    check_size,
    merge,
    training_weights,
    transformer_pass,
)
from elflow.util.devices import default_device
from elflow.util.errors import ELFError, Record, first_line
from elflow.util.files import NoSpace, atomic_write_json, disk_full, file_mode
from elflow.util.hub import hub_reachable


# ----------------------------------------------------------------------------------------------------------
# the judge
def load_judge(path_or_id: str | os.PathLike, dtype: str = "fp32", device: str | torch.device | None = None):
    """A causal LM and its tokenizer from a local folder or a hub id (never with remote code).

    The tokenizer's pad is set to its EOS (the protocol pads with EOS). dtype: "fp32" or "bf16".
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ELFError(f"judge dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if device is None:
        device = default_device()
    name = str(path_or_id)
    folder = Path(name).expanduser()
    kw = dict(trust_remote_code=False)
    if folder.is_dir():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype], **kw)
        except Exception as e:  # transformers' own errors, and torch's refusal of pickled weights
            raise ELFError(f"judge folder {str(folder)!r} does not hold a loadable causal LM and tokenizer "
                           f"({first_line(e)}); it needs config.json, safetensors weights and the tokenizer "
                           "files (save_pretrained writes them); pickled weights are never loaded") from None
    elif folder.exists() or name.startswith((".", "/", "~")) or name.endswith(os.sep) or name.count("/") > 1:
        raise ELFError(f"judge folder {name!r} does not exist; pass a folder holding a causal LM and its "
                       "tokenizer, or a hub id such as gpt2-large")
    else:
        def load(local_only: bool):
            tok = AutoTokenizer.from_pretrained(name, local_files_only=local_only, **kw)
            lm = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype], local_files_only=local_only, **kw)
            return lm, tok

        hint = (f"No local folder is called {name!r} and the judge is not in the Hugging Face cache. Without "
                "the hub, train the offline judge (`elflow train-judge --out runs/judge`) and pass "
                "`--judge runs/judge`; its numbers are comparable only with each other, not with GPT-2 Large.")
        try:
            model, tokenizer = load(local_only=True)
        except (OSError, ValueError):
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
            if offline or not hub_reachable():
                raise ELFError(f"cannot load judge {name!r}: the Hugging Face hub is not reachable"
                               f"{' (HF_HUB_OFFLINE is set)' if offline else ''}. {hint}") from None
            try:
                model, tokenizer = load(local_only=False)
            except (OSError, ValueError) as e:
                raise ELFError(f"cannot load judge {name!r} from the hub ({str(e).splitlines()[0]}). {hint}")
    if tokenizer.eos_token_id is None:
        raise ELFError(f"the judge tokenizer of {name!r} has no EOS token; the protocol pads with EOS")
    tokenizer.pad_token = tokenizer.eos_token
    model.eval().to(device)
    return model, tokenizer


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
    """Write a Hugging Face causal-LM folder (config, safetensors weights, tokenizer) plus elflow_judge.json.

    Everything is written into a hidden temporary folder inside `folder` first, then each file is moved into
    place, config.json last: a failure (a full disk) leaves `folder` as it was, and a folder with config.json
    holds a complete judge."""
    import shutil
    import tempfile

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-judge-", dir=folder))
    try:
        to_hf(judge).save_pretrained(tmp)
        tokenizer.model_max_length = judge.cfg.context
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / "elflow_judge.json",
                          {"note": NOT_GPT2_NOTE, "config": judge.cfg.to_dict(), **(info or {})})
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.chmod(f, file_mode())
            os.replace(f, folder / f.name)
    except Exception as e:
        if disk_full(e):
            raise NoSpace(folder, f"no space left on device while writing the judge into {folder}; nothing of it "
                                  "was written there: free some space, then run the command again") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# ----------------------------------------------------------------------------------------------------------
# training
class _JudgeTokens:
    """The judge's tokenizer in the form a token store is prepared with: ids without specials, EOS appended."""

    def __init__(self, tokenizer, eos_id: int):
        self.tokenizer, self.name = tokenizer, "gpt2"
        self.eos_id = self.pad_id = int(eos_id)
        self.vocab_size = len(tokenizer)
        self.tokenizer_id = tokenizer_fingerprint(tokenizer)

    def tokenize(self, texts: list[str], eos: bool = True) -> list[list[int]]:
        ids = self.tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [row + [self.eos_id] if eos else row for row in ids]


def _corpus_ids(data: str, tokenizer, eos_id: int, cache_dir=None) -> list[torch.Tensor]:
    """The documents of `data` as ids, each ending with EOS, read from its token store (prepared once)."""
    store, _ = text_store(data, _JudgeTokens(tokenizer, eos_id), cache_dir)
    return [torch.from_numpy(store.record(i)[0].astype("int64")) for i in range(len(store))]


def split_documents(docs: list, val_every: int) -> tuple[list, list]:
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


def check_judge_training(cfg: JudgeConfig, batch_size: int, steps: int, device=None) -> Estimate:
    """Refuse, before anything is built, a judge's training whose step count is past any real use or whose
    memory (weights, gradients and AdamW's two states; a training step's activations and logits over GPT-2's
    vocabulary) exceeds what `device` has available."""
    check_count(steps, "--steps", MAX_TRAINING_STEPS, "the judge trains for 200 steps by default")
    batch = check_size(batch_size, "--batch-size")
    H, M, V = cfg.hidden, cfg.mlp_hidden, cfg.vocab_size
    params = V * H + cfg.depth * block_params(H, cfg.heads, M) + H
    step = transformer_pass(batch, cfg.context, H, cfg.depth, cfg.heads, M, vocab=V, backward=True)
    flags = f"--batch-size {batch} --context {cfg.context} --hidden {H} --depth {cfg.depth} --heads {cfg.heads}"
    parts = merge({"weights and AdamW": training_weights(params, V * H)}, step)
    return check_fits(Estimate("training the judge", flags, parts,
                               "choose a smaller --batch-size, --context, --hidden or --depth"),
                      device or default_device())


def train_judge(out: str | Path, cfg: JudgeConfig = JudgeConfig(), data: str = "builtin", steps: int = 200,
                batch_size: int = 8, lr: float = 3e-3, warmup: int = 30, seed: int = 0, val_every: int = 10,
                device: str | None = None, cache_dir=None, progress: bool = True,
                documents: list[str] | None = None) -> dict:
    """Train the offline judge on `data` (minus its held-out documents) and save it to `out`; returns info.
    `documents`: train on these texts instead of reading `data` (which then only names them in the info).
    With `progress`, each phase before training is named on stderr as it starts, then a progress bar."""
    from tqdm.auto import tqdm

    def say(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    t0 = time.time()
    device = device or default_device()
    check_judge_training(cfg, batch_size, steps, device)
    say("train-judge: building the GPT-2 tokenizer (from its ranks, cached after the first run)")
    tokenizer = build_gpt2_tokenizer(cache_dir)
    if len(tokenizer) != cfg.vocab_size or tokenizer.eos_token_id != cfg.eos_id:
        raise ELFError(f"the tokenizer has {len(tokenizer)} tokens (EOS {tokenizer.eos_token_id}); the judge "
                       f"config expects {cfg.vocab_size} (EOS {cfg.eos_id})")
    if documents is not None:
        docs = [torch.tensor(ids) for ids in _JudgeTokens(tokenizer, cfg.eos_id).tokenize(list(documents))]
    else:
        say(f"train-judge: reading and tokenizing {data} (once: later runs read its cached token store)")
        docs = _corpus_ids(data, tokenizer, cfg.eos_id, cache_dir)
    train_docs, val_docs = split_documents(docs, val_every)
    train_ids, val_ids = _stream(train_docs), _stream(val_docs)
    if len(train_ids) <= cfg.context + 1:
        raise ELFError(f"only {len(train_ids)} training tokens in {data!r}: need more than {cfg.context + 1}")

    say(f"train-judge: {len(train_ids):,} training tokens, {len(val_ids):,} held out ({len(val_docs)} "
        f"document(s)); training {steps} steps on {device}")
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
