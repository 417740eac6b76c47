"""Embedding spaces: the frozen (or learned) map from token ids to the vectors ELF denoises.

One interface (`EmbeddingSpace`: tokenize, encode to x = (h - shift) / scale, decode, and a `space_id` stored
with a model) and three kinds: an encoder's last hidden state, a table of one vector per token, a tokenizer
alone (for the token baselines). `build_space(spec)` builds any of them; docs/internals.md has the details.
The encoders and tokenizers themselves are loaded by elflow.encoders.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from elflow.encoders import (
    load_config,
    load_encoder,
    load_tokenizer,
    max_positions,
    resolve_name,
    tokenizer_eos_id,
    tokenizer_fingerprint,
)
from elflow.util.budget import Estimate, check_fits
from elflow.util.errors import AT_LEAST_1, FINITE, SEED, ELFError, Record, positive

# ----------------------------------------------------------------------------------------------------
# Embedding spaces
DEFAULT_ENCODER = "minilm"  # the encoder of a spec that names none (a table space's base: "random-table")


T5_SMALL_STD = 0.2  # the paper's latent std for T5-small outputs


# the std of MiniLM-L6's last hidden states over all coordinates of the packed built-in corpus (L = 64), as
# latent_std="auto" measures it (docs/data.md)
MINILM_STD = 0.29


TABLE_KINDS = ("token-table", "random-table", "learned-table")


FIXED_TABLE_KINDS = ("token-table", "random-table")  # one frozen vector per token (what the table readout needs)


ENCODER_KINDS = ("t5", "hf")  # an encoder's last hidden state
KINDS = ENCODER_KINDS + TABLE_KINDS + ("tokens",)


DRAWN_TABLE_KINDS = ("random-table", "learned-table")  # tables drawn from a seed


TABLE_STREAM = 2  # the draw of a spec that names none; 1: the draw from the seed itself (specs stored without one)


TABLE_STREAMS = (1, 2)


def table_generator(seed: int, stream: int = TABLE_STREAM) -> torch.Generator:
    """The CPU generator a drawn table's vectors come from. Stream 2 seeds it with 63 bits of
    sha256("elflow table <seed>"), a seed no sampling or training generator is given; stream 1 seeds it with
    the space seed itself (so seed 0's table equals the first draws of any generator seeded with 0)."""
    if stream not in TABLE_STREAMS:
        raise ELFError(f"unknown table stream {stream!r}; this elflow knows streams {TABLE_STREAMS} (a space "
                       "stored by a newer elflow?)")
    if stream == 1:
        return torch.Generator().manual_seed(int(seed))
    digest = hashlib.sha256(f"elflow table {int(seed)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class EmbeddingSpace(nn.Module):
    """Base class: tokenizer + the map ids -> vectors, with the scale that makes the data roughly unit-variance.

    Subclasses implement `_embed(ids, attention)` returning raw vectors h (B, L, D); `encode` does the checks,
    the attention pattern and the scaling x = (h - shift) / scale.
    """

    kind: str = ""
    contextual: bool = False

    def __init__(self, tokenizer, name: str, label: str, scale: float, shift: float = 0.0,
                 max_length: int | None = None):
        super().__init__()
        self.tokenizer = tokenizer
        self.name = name  # as given in the spec (hub id, folder or "minilm")
        self.label = label  # short form used in space_id
        self.scale = float(scale)
        self.shift = float(shift)
        self.max_length = max_length
        self.eos_id = tokenizer_eos_id(tokenizer, name)
        self.pad_id = self.eos_id  # the paper pads with EOS
        self.vocab_size = len(tokenizer)
        self.tokenizer_id = tokenizer_fingerprint(tokenizer)

    # --- identity ---------------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        raise NotImplementedError

    @property
    def space_id(self) -> str:
        sid = f"{self.kind}:{self.label}:std{self.scale:.4g}"
        if self.shift:
            sid += f":shift{self.shift:.4g}"
        return sid

    def config(self) -> dict:
        """JSON-able spec that rebuilds this space with `build_space` (scales resolved to numbers)."""
        return {"kind": self.kind, "name": self.name, "latent_std": self.scale, "shift": self.shift}

    @property
    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters that train with the model (the learned table only); frozen weights are rebuilt."""
        return {k: p.detach() for k, p in self.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        for k, v in state.items():
            if k not in params:
                raise ELFError(f"checkpoint holds space parameter {k!r}, which the space {self.space_id} lacks")
            with torch.no_grad():
                params[k].copy_(v)

    def extra_repr(self) -> str:
        return f"space_id={self.space_id!r}, dim={self.dim}, vocab_size={self.vocab_size}"

    # --- text <-> ids -------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str], eos: bool = True, max_tokens: int | None = None) -> list[list[int]]:
        """Token ids per text, no padding, no tokenizer specials; one EOS appended to each if `eos`. With
        `max_tokens`, each text's first max_tokens ids (before the EOS), read from a prefix of the text that
        holds a few more (`_first_tokens`): a source of 75 MB on one line costs what its first tokens cost."""
        if isinstance(texts, str):
            texts = [texts]
        if not texts:
            return []
        if max_tokens is None:
            ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        else:
            ids = [self._first_tokens(text, max_tokens) for text in texts]
        return [list(row) + [self.eos_id] if eos else list(row) for row in ids]

    def _first_tokens(self, text: str, n: int) -> list[int]:
        """The first `n` ids of `text`: its prefix of 16 characters a token, doubled until it holds n + 8 ids
        (or is the whole text), so that the ids near the cut, which the rest of the text could change, lie past
        the n kept."""
        size = 16 * (n + 8)
        while True:
            ids = self.tokenizer(text[:size], add_special_tokens=False)["input_ids"]
            if size >= len(text) or len(ids) >= n + 8:
                return list(ids[:n])
            size *= 2

    def decode(self, ids) -> list[str]:
        """Per row: cut at the first EOS, drop special tokens, detokenize."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().tolist()
        rows = []
        for row in ids:
            row = list(row)
            if self.eos_id in row:
                row = row[: row.index(self.eos_id)]
            rows.append(row)
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    # --- ids -> vectors -----------------------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor, attention) -> torch.Tensor:
        raise NotImplementedError

    def check_length(self, length: int) -> None:
        if self.max_length is not None and length > self.max_length:
            raise ELFError(f"sequence length {length} is longer than the encoder {self.name!r} accepts "
                           f"({self.max_length} positions): use --length {self.max_length} or less, or a T5 "
                           "encoder (relative positions, no fixed limit)")

    def encode(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Scaled vectors x (B, L, D) in float32 for token ids (B, L).

        attention_mask: None (every token sees every token), (B, L) bool True at real tokens (the keys that
        may be attended to), or (B, L, L) bool, [i, j] = query i may see key j (the conditional pattern of
        `data.encoder_mask`). Non-contextual spaces ignore it.
        """
        if ids.dim() != 2:
            raise ValueError(f"encode expects token ids of shape (B, L), got {tuple(ids.shape)}")
        B, L = ids.shape
        self.check_length(L)
        attention = self._attention(attention_mask, ids.device) if self.contextual else None
        if self.trainable:
            h = self._embed(ids, attention)
        else:
            with torch.no_grad():
                h = self._embed(ids, attention)
        return (h.float() - self.shift) / self.scale  # (B, L, D)

    def _attention(self, mask, device):
        """None, a (B, L) padding mask, or an additive (B, 1, L, L) mask for a per-query pattern. A padding
        mask is passed on as it is, all ones too (the encoders give the numbers of no mask then), so that
        encoding reads no value on the host."""
        if mask is None:
            return None
        mask = mask.to(device=device, dtype=torch.bool)
        if mask.dim() == 2:
            return mask.long()
        dtype = self._compute_dtype()
        additive = torch.zeros(mask.shape[0], 1, *mask.shape[1:], dtype=dtype, device=device)
        return additive.masked_fill(~mask[:, None], torch.finfo(dtype).min)

    def _compute_dtype(self) -> torch.dtype:
        for p in self.parameters():
            return p.dtype
        for b in self.buffers():
            return b.dtype
        return torch.float32


class EncoderSpace(EmbeddingSpace):
    """Last hidden state of a frozen Hugging Face encoder (kind "t5" or "hf")."""

    contextual = True

    def __init__(self, kind: str, name: str, latent_std, shift: float = 0.0, device=None, dtype=None):
        target, local, label = resolve_name(name)
        tokenizer = load_tokenizer(target, local, name)
        encoder = load_encoder(target, local, name, dtype=dtype)
        if kind == "t5" and encoder.config.model_type not in ("t5", "mt5", "umt5"):
            raise ELFError(f"{name!r} is a {encoder.config.model_type} model, not T5: use kind 'hf' for it")
        kind = "t5" if encoder.config.model_type in ("t5", "mt5", "umt5") else "hf"
        self.kind = kind
        scale = 1.0 if isinstance(latent_std, str) else float(latent_std)
        super().__init__(tokenizer, name, label, scale, shift, max_positions(encoder.config))
        self.encoder = encoder
        if device is not None:
            self.encoder.to(device)

    @property
    def dim(self) -> int:
        return int(self.encoder.get_input_embeddings().weight.shape[1])

    def train(self, mode: bool = True):
        super().train(mode)
        self.encoder.eval()  # frozen: never dropout
        return self

    def _embed(self, ids, attention):
        out = self.encoder(input_ids=ids, attention_mask=attention)
        return out.last_hidden_state  # (B, L, D)


class TableSpace(EmbeddingSpace):
    """One vector per token id: the encoder's input table, a frozen Gaussian table, or a learned table."""

    contextual = False

    def __init__(self, kind: str, name: str, latent_std, shift: float = 0.0, dim: int | None = None,
                 seed: int = 0, device=None, dtype=None, stream: int = TABLE_STREAM):
        if kind not in TABLE_KINDS:
            raise ELFError(f"unknown table kind {kind!r}; choose one of {', '.join(TABLE_KINDS)}")
        gen = table_generator(seed, stream) if kind in DRAWN_TABLE_KINDS else None
        target, local, label = resolve_name(name)
        tokenizer = load_tokenizer(target, local, name)
        self.kind = kind
        self.seed = int(seed)
        self.stream = int(stream)
        if kind == "token-table":
            encoder = load_encoder(target, local, name)
            weight = encoder.get_input_embeddings().weight.detach().float().clone()  # (V_model, D)
            max_length = max_positions(encoder.config)
            del encoder
        else:
            if dim is None:
                config = load_config(target, local, name)
                dim = getattr(config, "d_model", None) or getattr(config, "hidden_size")
            n_rows = len(tokenizer)
            check_fits(Estimate(f"the {kind} space", f"{n_rows} x {dim} vectors", {"table": n_rows * int(dim) * 4},
                                "choose a smaller --space-dim"))
            weight = torch.randn(n_rows, int(dim), generator=gen)  # N(0, 1): unit scale by construction
            max_length = None
        if latent_std == "table":
            scale = float(weight.std())
        elif isinstance(latent_std, str):
            scale = 1.0  # "auto": measured on a sample (build_space's calibration)
        else:
            scale = float(latent_std)
        super().__init__(tokenizer, name, label, scale, shift, max_length)
        if dtype is not None:
            weight = weight.to(dtype)
        if kind == "learned-table":
            self.table = nn.Parameter(weight)  # trains with the denoiser
        else:
            self.register_buffer("table", weight, persistent=False)  # rebuilt from the spec
        if device is not None:
            self.to(device)

    @property
    def dim(self) -> int:
        return int(self.table.shape[1])

    @property
    def space_id(self) -> str:
        sid = super().space_id
        if self.kind != "token-table":
            sid += f":d{self.dim}:seed{self.seed}" + (f":stream{self.stream}" if self.stream != 1 else "")
        return sid

    def config(self) -> dict:
        cfg = super().config()
        if self.kind != "token-table":
            cfg.update(dim=self.dim, seed=self.seed, stream=self.stream)
        return cfg

    def _embed(self, ids, attention):
        return nn.functional.embedding(ids, self.table)  # (B, L, D)


class TokenizerSpace(EmbeddingSpace):
    """The tokenizer of the space `of` (a spec), without its vectors: ids, EOS / pad, decoding and the vector
    size `dim` that the space would have (read from the encoder's config, or a table's own `dim`), so that an
    ELF network of the same space can be sized without loading the encoder. `encode` refuses. Its id names
    the tokenizer by its fingerprint: two spaces with the same tokenizer give the same token streams."""

    kind = "tokens"

    def __init__(self, of: dict, dim: int | None = None):
        of = _normalise_spec(of)
        if of["kind"] == "tokens":
            raise ELFError("a tokens space is built from an embedding space's spec, not from another tokens space")
        name = str(of["name"])
        target, local, label = resolve_name(name)
        tokenizer = load_tokenizer(target, local, name)
        if dim is None:
            dim = of.get("dim") if of["kind"] in ("random-table", "learned-table") else None
        if dim is None:
            config = load_config(target, local, name)
            dim = getattr(config, "d_model", None) or getattr(config, "hidden_size")
        super().__init__(tokenizer, name, label, 1.0, 0.0, None)  # no encoder: no length limit
        self.of = {k: v for k, v in of.items() if k in ("kind", "name", "dim", "seed")}
        self._dim = int(dim)

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def space_id(self) -> str:
        return f"tokens:{self.label}:{self.tokenizer_id}"

    def config(self) -> dict:
        return {"kind": "tokens", "of": dict(self.of), "dim": self._dim}

    def _embed(self, ids, attention):
        raise ELFError(f"the space {self.space_id} holds a tokenizer only (a token-level baseline's); it has no "
                       "vectors to encode")


# ----------------------------------------------------------------------------------------------------
# The spec stored with a model
LATENT_STD_WORDS = ("auto", "table")  # a scale the space finds itself: measured on a sample, or its table's own


def usable_latent_std(v) -> bool:
    """Whether `v` is a latent std a space takes: a positive number, or one of LATENT_STD_WORDS."""
    return v in LATENT_STD_WORDS or isinstance(v, (int, float)) and not isinstance(v, bool) and positive(v)


LATENT_STD = (usable_latent_std, "a positive number, 'auto' or 'table'")  # --latent-std, a stored space's


@dataclass(frozen=True)
class SpaceSpec(Record):
    """A space as a model stores it: what `build_space` rebuilds it from, and the id of the space it was
    trained in (checked against the space built). kind: one of KINDS; name: the encoder or tokenizer (hub id,
    folder or "minilm"; a tokens space names none, its base is `of`); latent_std: a number, "auto" or "table";
    dim, seed, stream: a drawn table's; of: a tokens space's base spec."""

    kind: str
    name: str = ""
    latent_std: float | str | None = None
    shift: float = 0.0
    dim: int | None = None
    seed: int | None = None
    stream: int | None = None
    of: dict | None = None
    id: str | None = None

    DECLARED = {"latent_std": (LATENT_STD, None), "shift": (FINITE, None), "dim": (AT_LEAST_1, None),
                "seed": (SEED, None), "stream": (None, TABLE_STREAMS)}

    @classmethod
    def from_dict(cls, d, space_id: str | None = None) -> "SpaceSpec":
        """The spec of a stored dict (a built space's `config()`), checked field by field: ValueError naming the
        field for a value of the wrong type or out of range."""
        if not isinstance(d, dict):
            raise ValueError(f"a space spec is a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - {"kind", "name", "latent_std", "shift", "dim", "seed", "stream", "of", "id"})
        if unknown:
            raise ValueError(f"unknown fields {unknown}")
        kind, name = d.get("kind"), d.get("name", "")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(name, str) or (kind != "tokens" and not name):
            raise ValueError(f"name must name an encoder or tokenizer, got {name!r}")
        of = d.get("of")
        if kind == "tokens":
            if not isinstance(of, dict):
                raise ValueError("a tokens space needs 'of', the spec of the space whose tokenizer it uses")
            cls.from_dict({k: v for k, v in of.items() if k != "id"})
        elif of is not None:
            raise ValueError(f"'of' belongs to a tokens space, not to a {kind} space")
        sid = d.get("id", space_id)
        if sid is not None and not isinstance(sid, str):
            raise ValueError(f"id must be a string, got {sid!r}")
        spec = cls(kind, name, d.get("latent_std"), d.get("shift", 0.0), d.get("dim"), d.get("seed"), d.get("stream"),
                   of, sid)
        spec.check_declared()
        return replace(spec, shift=float(spec.shift))

    def to_dict(self) -> dict:
        """The stored form: the fields that are set (a tokens space without its empty name)."""
        out = {"kind": self.kind, "name": self.name, "latent_std": self.latent_std, "shift": self.shift,
               "dim": self.dim, "seed": self.seed, "stream": self.stream, "of": self.of, "id": self.id}
        return {k: v for k, v in out.items() if v is not None and not (k == "name" and v == "")}

    def build_spec(self) -> dict:
        """The dict `build_space` takes."""
        return {k: v for k, v in self.to_dict().items() if k != "id"}

    @classmethod
    def of_space(cls, space: "EmbeddingSpace") -> "SpaceSpec":
        """The spec of a built space, with its id."""
        return cls.from_dict(space.config(), space.space_id)


def latent_std_of(text: str):
    """A latent std given as text (--latent-std, a stored setting of version 9): the number it writes, else the
    text itself (a word of LATENT_STD_WORDS; another is refused by `usable_latent_std`)."""
    try:
        return float(text)
    except ValueError:
        return text


# ----------------------------------------------------------------------------------------------------
# Building from a spec
def _normalise_spec(spec) -> dict:
    if isinstance(spec, EmbeddingSpace):
        return spec.config()
    if isinstance(spec, SpaceSpec):
        return spec.build_spec()
    if isinstance(spec, str):
        return parse_space(spec)
    if not isinstance(spec, dict):
        raise ELFError(f"an embedding space spec must be a name or a dict, got {type(spec).__name__}")
    spec = dict(spec)
    spec.setdefault("kind", "hf")
    spec.setdefault("name", DEFAULT_ENCODER)
    if spec["kind"] not in KINDS:
        raise ELFError(f"unknown embedding space kind {spec['kind']!r}; choose one of {', '.join(KINDS)}")
    return spec


def parse_space(text: str) -> dict:
    """The kind and encoder a --space value names ({"kind", "name"}): minilm, t5-small (or any T5 hub id or
    folder), t5:PATH, hf:PATH, another hub id or folder (an encoder through AutoModel), or a non-contextual table
    over a base encoder's vocabulary: token-table[:BASE], random-table[:BASE], learned-table[:BASE]."""
    s = text.strip()
    kind, sep, base = s.partition(":")
    if sep and not base and kind in (*TABLE_KINDS, *ENCODER_KINDS):
        hint = f"as in {kind}:minilm, or leave the colon out" if kind in TABLE_KINDS else f"as in {kind}:t5-small"
        raise ELFError(f"--space {text!r} names no encoder after its colon; give its folder or hub id, {hint}")
    if kind in TABLE_KINDS:
        return {"kind": kind, "name": base if sep else DEFAULT_ENCODER}
    if s == "minilm":
        return {"kind": "hf", "name": "minilm"}
    if sep and kind in ENCODER_KINDS:
        return {"kind": kind, "name": base}
    low = s.lower()
    if Path(s).name.lower().startswith(("t5-", "t5_", "google-t5", "google/t5")) or low.startswith("google-t5/t5"):
        return {"kind": "t5", "name": s}
    return {"kind": "hf", "name": s}


def space_name(spec) -> str:
    """The --space value that names `spec`'s kind and encoder (a SpaceSpec or a dict): `parse_space`'s inverse."""
    kind, name = (spec.kind, spec.name) if isinstance(spec, SpaceSpec) else (spec.get("kind"), spec.get("name", ""))
    bare = name if kind not in TABLE_KINDS else None
    return bare if bare is not None and parse_space(bare) == {"kind": kind, "name": name} else f"{kind}:{name}"


def space_kind(space) -> str:
    """The kind of a space: of a --space value ("random-table:minilm"), a spec or a built space."""
    return _normalise_spec(space)["kind"]


def fixed_vectors(space) -> bool:
    """Whether a space gives every token one frozen vector of its own (what the table readout needs)."""
    return space_kind(space) in FIXED_TABLE_KINDS


def drawn_table(space) -> bool:
    """Whether a space's vectors are drawn from its seed (a random or learned table)."""
    return space_kind(space) in DRAWN_TABLE_KINDS


def learned(space) -> bool:
    """Whether a space trains with the network (a learned table)."""
    return space_kind(space) == "learned-table"


def tokenizer_spec(spec) -> dict:
    """The spec of a space's tokenizer alone (what the token baselines read and write), from a spec or a name."""
    spec = _normalise_spec(spec)
    return spec if spec["kind"] == "tokens" else {"kind": "tokens", "of": spec}


def with_encoder(spec: dict, name: str) -> dict:
    """A stored encoder space's spec with its encoder read from `name`, a folder or hub id (the authors'
    checkpoints offline: a local copy of T5-small); a spec of another kind is taken as T5's."""
    kind = spec.get("kind") if spec.get("kind") in ENCODER_KINDS else "t5"
    return {**spec, "kind": kind, "name": name, "latent_std": spec.get("latent_std", T5_SMALL_STD)}


def _default_std(kind: str, name: str):
    if kind in ENCODER_KINDS:
        if name == "minilm":
            return MINILM_STD
        if Path(name).name in ("t5-small", "google-t5/t5-small") or name in ("t5-small", "google-t5/t5-small"):
            return T5_SMALL_STD
        return "auto"
    if kind == "token-table":
        return "table"
    return 1.0  # random and learned tables are N(0, 1)


def build_space(spec: SpaceSpec | dict | str, device=None, dtype=None, calibration=None) -> EmbeddingSpace:
    """Build an embedding space from a name or a dict.

    Names: "minilm" (offline default), a hub id such as "t5-small", a local folder, "t5:<name>", "hf:<name>",
    or a table kind. Dict keys: kind ("t5" | "hf" | "token-table" | "random-table" | "learned-table" |
    "tokens", a tokenizer alone: {"kind": "tokens", "of": <another spec>}),
    name (hub id, folder or "minilm"; for tables it names the tokenizer / encoder), latent_std (number,
    "auto" to estimate it from a data sample, or for token tables "table" = std of the table), shift,
    dim, seed and stream (random / learned tables; stream 2 unless given: `table_generator`).
    `calibration(space)` sets the scale of a latent_std "auto" from a data sample (the space knows no data:
    elflow.data.corpus.calibration_for(spec) measures it on the spec's calibrate_on / calibrate_length /
    calibrate_sequences, by default 256 rows of 64 tokens of the built-in corpus).
    """
    spec = _normalise_spec(spec)
    if spec["kind"] == "tokens":
        if not isinstance(spec.get("of"), dict):
            raise ELFError("a tokens space spec needs 'of', the spec of the embedding space whose tokenizer it uses")
        return TokenizerSpace(spec["of"], spec.get("dim"))
    kind, name = spec["kind"], str(spec["name"])
    latent_std = spec.get("latent_std", None)
    if latent_std is None:
        latent_std = _default_std(kind, name)
    if isinstance(latent_std, str) and latent_std not in ("auto", "table"):
        raise ELFError(f"latent_std must be a number, 'auto' or 'table', got {latent_std!r}")
    if latent_std == "table" and kind != "token-table" and kind not in ("random-table", "learned-table"):
        raise ELFError("latent_std='table' only applies to table spaces; use a number or 'auto'")
    if not isinstance(latent_std, str) and not float(latent_std) > 0:
        raise ELFError(f"latent_std must be positive, got {latent_std}")
    shift = float(spec.get("shift", 0.0))
    if kind in ENCODER_KINDS:
        space = EncoderSpace(kind, name, latent_std, shift, device=device, dtype=dtype)
    else:
        space = TableSpace(kind, name, latent_std, shift, dim=spec.get("dim"), seed=spec.get("seed", 0),
                           device=device, dtype=dtype, stream=spec.get("stream", TABLE_STREAM))
    if latent_std == "auto":
        if calibration is None:
            raise ELFError("latent_std 'auto' is measured on a data sample: build the space with a calibration "
                           "sample (elflow.data.corpus.calibration_for)")
        calibration(space)
    return space


@torch.no_grad()
def latent_moments(space, dataset, batch: int = 32, max_rows: int = 512, device="cpu"):
    """Per-dimension mean and variance (C,) of a space's clean embeddings x at a dataset's loss positions,
    over `max_rows` rows spread evenly over the dataset (all rows of a smaller one)."""
    rows = torch.linspace(0, len(dataset) - 1, min(len(dataset), max_rows)).round().long().unique()
    s = s2 = None
    n = 0
    for i in range(0, len(rows), batch):
        b = dataset.batch(rows[i:i + batch])
        x = space.encode(b["tokens"].to(device), attention_mask=b.get("attention_mask")).double()
        m = b["mask"].to(device)[..., None].double()
        s = (x * m).sum((0, 1)) if s is None else s + (x * m).sum((0, 1))
        s2 = (x * x * m).sum((0, 1)) if s2 is None else s2 + (x * x * m).sum((0, 1))
        n += m.sum().item()
    if not n:
        raise ELFError("the dataset has no scored positions to measure the embeddings' moments on")
    mu = s / n
    return mu.float(), (s2 / n - mu * mu).clamp_min(1e-8).float()


@torch.no_grad()
def token_vectors(space, vocab_size: int, device="cpu", batch: int = 4096) -> torch.Tensor:
    """The clean embedding of each token id alone, (vocab_size, C), for a space with one fixed vector per token
    (a frozen table); the table readout (elflow.model.ShortRunOptions) compares the decode input with these."""
    if space.contextual or not isinstance(space, TableSpace):
        raise ELFError(f"the table readout needs a space with one vector per token (random-table or token-table); "
                       f"{space.space_id} embeds tokens in context. Pass --table-readout 0, or choose a table space")
    if space.trainable:
        raise ELFError(f"the table readout needs fixed token vectors, but {space.space_id} trains its table; "
                       "choose random-table or token-table, or pass --table-readout 0")
    ids = torch.arange(vocab_size, device=device)
    # each token alone, a column of one-token rows: no sequence longer than one position (a token table of
    # an encoder with a position limit, MiniLM's 512, accepts it)
    return torch.cat([space.encode(ids[i:i + batch, None])[:, 0].float() for i in range(0, vocab_size, batch)])


def check_compatible(stored_space_id: str, space: EmbeddingSpace) -> None:
    """Refuse to run a checkpoint in an embedding space other than the one it was trained in."""
    if stored_space_id != space.space_id:
        raise ELFError(
            f"embedding space mismatch: the checkpoint was trained in {stored_space_id!r} but the current space "
            f"is {space.space_id!r}. Build the space from the checkpoint's stored space config "
            "(build_space(checkpoint['space'])), or pass the matching --space / --latent-std"
        )
