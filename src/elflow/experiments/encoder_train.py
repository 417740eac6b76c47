"""`elflow train-encoder`: a small T5 encoder trained from scratch by span corruption, saved as a folder that
is an embedding space (`--space t5:FOLDER`)."""

from __future__ import annotations

import math
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from elflow.data.corpus import read_documents
from elflow.util.budget import (
    MAX_TRAINING_STEPS,
    Estimate,
    check_count,
    check_fits,
    check_size,
    merge,
    tensor,
    training_weights,
    transformer_pass,
)
from elflow.util.devices import default_device
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_json


def span_noise_mask(length: int, density: float, mean_span: float, rng: np.random.Generator) -> np.ndarray:
    """A (length,) bool mask with round(length x density) noise tokens in round(noise / mean_span) spans
    (at least one of each), the spans and the gaps between them of random lengths, starting with a gap (T5's
    random_spans_noise_mask)."""
    noise = min(max(int(round(length * density)), 1), length - 1)
    spans = max(int(round(noise / mean_span)), 1)
    spans = min(spans, noise, length - noise)

    def split(total: int) -> np.ndarray:  # `total` items into `spans` non-empty segments, at random
        cuts = np.sort(rng.choice(np.arange(1, total), spans - 1, replace=False)) if spans > 1 else np.array([], int)
        return np.diff(np.concatenate([[0], cuts, [total]]))

    noise_lengths, keep_lengths = split(noise), split(length - noise)
    starts = np.cumsum(np.stack([keep_lengths, noise_lengths], axis=1).reshape(-1))[:-1]  # gap, span, gap, ...
    marks = np.zeros(length, dtype=np.int64)
    marks[starts] = 1
    return np.cumsum(marks) % 2 == 1  # odd segments are spans


def corrupt_spans(ids: np.ndarray, mask: np.ndarray, sentinels: list[int], eos: int) -> tuple[list[int], list[int]]:
    """(input, target) of one window: each noise span replaced by the next sentinel in the input; the target
    is each sentinel followed by the span it stands for, then EOS."""
    first = mask & ~np.concatenate([[False], mask[:-1]])  # the first token of each span
    span_index = np.cumsum(first) - 1  # which span each token is in (valid on noise tokens)
    if span_index.max(initial=-1) >= len(sentinels):
        raise ELFError(f"a window has more noise spans than the tokenizer's {len(sentinels)} sentinels; use a "
                       "shorter --length or a longer --span")
    sentinel = np.array(sentinels)[np.clip(span_index, 0, None)]
    inputs = np.where(first, sentinel, ids)[~mask | first]
    targets = np.where(first, sentinel, -1)
    targets = np.stack([targets, np.where(mask, ids, -1)], axis=1).reshape(-1)  # sentinel slot, then the token
    return inputs.tolist(), [int(t) for t in targets if t >= 0] + [eos]


def _tokenizer(docs: list[str], vocab: int, sentinels: int, folder: Path):
    """A T5 tokenizer (sentencepiece unigram, pad 0, EOS 1, unk 2, `sentinels` extra ids) trained on `docs`, in
    a temporary folder inside `folder`: nothing is left in `folder` (the caller saves it with the encoder)."""
    import sentencepiece as spm
    from transformers import T5Tokenizer

    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        text = Path(tmp) / "train.txt"
        text.write_text("\n".join(line for d in docs for line in d.splitlines() if line.strip()), encoding="utf-8")
        try:
            spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(Path(tmp) / "spiece"),
                                           vocab_size=vocab, model_type="unigram", pad_id=0, eos_id=1, unk_id=2,
                                           bos_id=-1, character_coverage=1.0, minloglevel=2)
        except RuntimeError as e:
            raise ELFError(vocab_advice(str(e), vocab, text.read_text(encoding="utf-8"))) from None
        text.unlink()
        saved = Path(tmp) / "saved"
        T5Tokenizer.from_pretrained(tmp, extra_ids=sentinels).save_pretrained(str(saved))
        return T5Tokenizer.from_pretrained(str(saved))


def vocab_advice(error: str, vocab: int, text: str) -> str:
    """sentencepiece's refusal of a --vocab for `text` as one line with the --vocab that works: at least one
    piece per distinct character and the special tokens, at most what the corpus can fill."""
    last = (error.strip().splitlines() or [""])[-1]
    high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", last)
    if high:
        return (f"--vocab {vocab} is more pieces than this corpus can fill (at most {high.group(2)}): pass --vocab "
                f"{high.group(2)} or less, or more data")
    low = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", last)
    need = int(low.group(2)) if low else len(set(text) - {"\n"}) + 3  # the characters, pad / EOS / unk
    if low or vocab < need:
        return (f"--vocab {vocab} is fewer pieces than this corpus needs ({need}: one per distinct character, and "
                f"the special tokens): pass --vocab {need} or more")
    return f"the tokenizer cannot be trained on this corpus ({last[:200]}); try another --vocab or more data"


def _windows(tokenizer, docs: list[str], length: int) -> np.ndarray:
    """The documents' ids, each followed by EOS, concatenated and cut into (N, length) windows."""
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    stream = np.array([t for doc in ids for t in doc + [tokenizer.eos_token_id]], dtype=np.int64)
    n = len(stream) // length
    if n < 2:
        raise ELFError(f"the corpus has {len(stream)} tokens, fewer than two windows of --length {length}")
    return stream[:n * length].reshape(n, length)


def _batch(windows: np.ndarray, rows: np.ndarray, density: float, span: float, sentinels: list[int], eos: int,
           rng: np.random.Generator):
    """Span-corrupted (input_ids, attention_mask, labels) of the chosen windows, padded (labels with -100)."""
    pairs = [corrupt_spans(windows[r], span_noise_mask(windows.shape[1], density, span, rng), sentinels, eos)
             for r in rows]
    n_in, n_out = max(len(a) for a, _ in pairs), max(len(b) for _, b in pairs)
    inputs = torch.zeros(len(pairs), n_in, dtype=torch.long)
    labels = torch.full((len(pairs), n_out), -100, dtype=torch.long)
    for i, (a, b) in enumerate(pairs):
        inputs[i, :len(a)] = torch.tensor(a)
        labels[i, :len(b)] = torch.tensor(b)
    return inputs, (inputs != 0).long(), labels


@torch.no_grad()
def _heldout_loss(model, batches, device) -> float:
    """Mean cross-entropy per target token over fixed held-out batches."""
    model.eval()
    total, count = 0.0, 0
    for inputs, attention, labels in batches:
        out = model(input_ids=inputs.to(device), attention_mask=attention.to(device), labels=labels.to(device))
        n = int((labels != -100).sum())
        total, count = total + float(out.loss) * n, count + n
    model.train()
    return total / count


def _unigram_entropy(batches, train_labels: list[torch.Tensor]) -> float:
    """Cross-entropy of the held-out targets under the training targets' token frequencies (add-one)."""
    counts = torch.bincount(torch.cat([t[t != -100] for t in train_labels]))
    held = torch.cat([b[2][b[2] != -100] for b in batches])
    size = max(len(counts), int(held.max()) + 1)
    counts = torch.nn.functional.pad(counts, (0, size - len(counts))).double() + 1
    return float(-(counts / counts.sum()).log()[held].mean())


def window_lengths(length: int, density: float, span: float) -> tuple[int, int]:
    """(input, target) lengths of a span-corrupted window of `length` tokens (`span_noise_mask`'s counts)."""
    noise = min(max(int(round(length * density)), 1), length - 1)
    spans = min(max(int(round(noise / span)), 1), noise, length - noise)
    return length - noise + spans, noise + spans + 1


def check_encoder_training(*, vocab: int, length: int, density: float, span: float, hidden: int, depth: int,
                           heads: int, batch: int, steps: int, sentinels: int = 100, device=None) -> Estimate:
    """Refuse, before anything is read or written, a training whose step count is past any real use or whose
    memory exceeds what `device` has available: the T5's weights, gradients and AdamW states, and a step of its
    encoder and decoder (T5 writes attention out: every block keeps its scores; its tanh GELU keeps about 12
    buffers of the MLP's width), the logits over the vocabulary and its sentinels."""
    check_count(steps, "--steps", MAX_TRAINING_STEPS, "the encoder trains for 300 steps by default")
    if not (0 < density < 1 and span >= 1):
        raise ELFError(f"--density must lie in (0, 1) and --span be at least 1, got {density} and {span}")
    for flag, v in (("--vocab", vocab), ("--length", length), ("--hidden", hidden), ("--depth", depth),
                    ("--heads", heads), ("--batch", batch)):
        check_size(v, flag)
    V, H, F = 64 * math.ceil((vocab + sentinels) / 64), hidden, 4 * hidden
    n_in, n_out = window_lengths(length, density, span)
    params = V * H + depth * (12 * H * H + 6 * H * F + 5 * H) + 2 * 32 * heads + 2 * H
    saved = 12 * H + 6 * F
    encoder = transformer_pass(batch, n_in, H, depth, heads, F, backward=True, eager_attention=True, saved=saved)
    decoder = transformer_pass(batch, n_out, H, depth, heads, F, vocab=V, backward=True, eager_attention=True,
                               saved=saved + 8 * H)
    cross = {"attention": 3 * depth * tensor(batch, heads, n_out, n_in), "encoder states": 2 * depth * tensor(
        batch, n_in, H)}
    flags = (f"--vocab {vocab} --length {length} --hidden {H} --depth {depth} --heads {heads} --batch {batch}")
    return check_fits(Estimate("training the encoder", flags, merge(
        {"weights and AdamW": training_weights(params, V * H)}, encoder, decoder, cross),
        "choose a smaller --batch, --length, --hidden, --depth or --vocab"), device or default_device())


def train_encoder(out, data: str = "builtin", *, vocab: int = 2000, sentinels: int = 100, length: int = 64,
                  density: float = 0.15, span: float = 3.0, hidden: int = 128, depth: int = 2, heads: int = 4,
                  steps: int = 300, batch: int = 32, lr: float = 2e-3, warmup: int = 30, seed: int = 0,
                  val_every: int = 20, device=None, cache_dir=None, progress: bool = True,
                  on_bad: str = "stop") -> dict:
    """Train a T5 encoder from scratch by span corruption on `data` and save it to `out`; returns its info.
    `on_bad`: empty, binary or non-UTF-8 files and bad jsonl lines stop it ("stop") or are skipped ("skip")."""
    from tqdm.auto import tqdm
    from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration

    t0 = time.time()
    device = torch.device(device or default_device())
    check_encoder_training(vocab=vocab, length=length, density=density, span=span, hidden=hidden, depth=depth,
                           heads=heads, batch=batch, steps=steps, sentinels=sentinels, device=device)
    docs = list(read_documents(data, on_bad=on_bad, cache_dir=cache_dir))
    if not docs:
        raise ELFError(f"--data {data!r} holds no documents")
    if len(docs) < val_every:  # a few long texts: their lines as documents
        docs = [line for d in docs for line in d.splitlines() if line.strip()]
    held = [d for i, d in enumerate(docs) if i % val_every == val_every - 1]
    train_docs = [d for i, d in enumerate(docs) if i % val_every != val_every - 1]
    if not held or not train_docs:
        raise ELFError(f"--data {data!r} is too small to hold out every {val_every}-th document")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(train_docs, vocab, sentinels, out)
    sentinel_ids = tokenizer.convert_tokens_to_ids([f"<extra_id_{i}>" for i in range(sentinels)])
    eos = tokenizer.eos_token_id
    train_windows, held_windows = _windows(tokenizer, train_docs, length), _windows(tokenizer, held, length)

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    held_rng = np.random.default_rng(seed + 1)
    held_rows = np.arange(min(len(held_windows), 256))
    held_batches = [_batch(held_windows, held_rows[i:i + batch], density, span, sentinel_ids, eos, held_rng)
                    for i in range(0, len(held_rows), batch)]
    vocab_rows = 64 * math.ceil(len(tokenizer) / 64)
    config = T5Config(vocab_size=vocab_rows, d_model=hidden, d_kv=hidden // heads, d_ff=4 * hidden, num_layers=depth,
                      num_decoder_layers=depth, num_heads=heads, dropout_rate=0.0, pad_token_id=0, eos_token_id=eos,
                      decoder_start_token_id=0, feed_forward_proj="gated-gelu")
    model = T5ForConditionalGeneration(config).to(device)
    initial = _heldout_loss(model, held_batches, device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    seen_labels = []
    bar = tqdm(range(steps), disable=not progress, desc="train-encoder", unit="step")
    loss_ema = None
    for step in bar:
        for g in opt.param_groups:  # linear warm-up, cosine decay to 10%
            frac = max(0.0, (step - warmup) / max(1, steps - warmup))
            g["lr"] = lr * min(1.0, (step + 1) / max(1, warmup)) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        rows = rng.integers(0, len(train_windows), batch)
        inputs, attention, labels = _batch(train_windows, rows, density, span, sentinel_ids, eos, rng)
        if len(seen_labels) < 64:
            seen_labels.append(labels)
        loss = model(input_ids=inputs.to(device), attention_mask=attention.to(device), labels=labels.to(device)).loss
        if not torch.isfinite(loss):
            raise ELFError(f"non-finite loss at step {step}; nothing was saved. Try a lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
        bar.set_postfix(loss=f"{loss_ema:.3f}")
    final = _heldout_loss(model, held_batches, device)

    encoder = T5EncoderModel(config)
    own = encoder.state_dict()
    encoder.load_state_dict({k: v for k, v in model.state_dict().items() if k in own})
    tokenizer.save_pretrained(str(out))
    encoder.save_pretrained(str(out))
    info = {"data": str(data), "steps": steps, "batch": batch, "length": length, "lr": lr, "seed": seed,
            "vocab": len(tokenizer), "hidden": hidden, "depth": depth, "heads": heads, "density": density,
            "span": span, "train_windows": len(train_windows), "heldout_windows": len(held_rows),
            "heldout_loss": final, "heldout_loss_at_init": initial,
            "heldout_unigram_entropy": _unigram_entropy(held_batches, seen_labels),
            "seconds": time.time() - t0}
    atomic_write_json(out / "elflow_encoder.json", info)
    return info
