"""Layouts of token rows (every row L tokens, pad = EOS): documents packed or one per row, (source, target)
pairs in the released or the fixed source slot, and the encoder mask that hides a dropped source."""

from __future__ import annotations

import torch

from elflow.util.errors import ELFError


def pack(docs_ids: list[list[int]], length: int, eos_id: int) -> torch.Tensor:
    """Join documents (each ending with EOS) and cut into (N, length) chunks; the partial tail is dropped."""
    flat = [t for ids in docs_ids for t in (ids if ids and ids[-1] == eos_id else list(ids) + [eos_id])]
    n = len(flat) // length
    if n == 0:
        raise ELFError(f"the corpus has only {len(flat)} tokens, shorter than one sequence of {length}: use a "
                       "smaller --length or more text")
    return torch.tensor(flat[: n * length], dtype=torch.long).view(n, length)  # (N, L)


def encoder_mask(known: torch.Tensor, valid: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
    """The encoder's attention for rows with known (source) positions: (B, L, L) bool, [i, j] = query i may
    see key j. Known queries see only known keys; the others see every real key,
    mask[i, j] = (known_i and known_j) or (not known_i and valid_j). On rows with drop (B,) True the other
    queries may not see the known keys either (the source dropped for guidance training)."""
    k_i, k_j = known[:, :, None], known[:, None, :]
    allowed = (k_i & k_j) | (~k_i & valid[:, None, :])
    if drop is not None:
        allowed = allowed & ~(drop.to(known.device, torch.bool)[:, None, None] & ~k_i & k_j)
    return allowed


PACKED, DOCUMENT, FIXED = "packed", "document", "fixed"
LAYOUTS = (PACKED, DOCUMENT)  # text rows: documents run on across rows, or one document per row
SOURCE_SLOTS = (PACKED, FIXED)  # where a pair's target starts: right after its source, or at source_length


def check_source_slot(source_slot: str) -> None:
    if source_slot not in SOURCE_SLOTS:
        raise ELFError(f"unknown source slot {source_slot!r}; choose one of {', '.join(SOURCE_SLOTS)}")


def pair_layout(sources: list[list[int]], targets: list[list[int]], length: int, max_source_length: int,
                pad_id: int, source_slot: str = PACKED) -> dict:
    """Rows of source + target ids, the target starting right after its (variable-length) source.

    Each source is cut to max_source_length ids, the target follows it immediately, and the row is cut or
    padded with pad_id (EOS: the model learns where a target ends) to `length`. With `source_slot="fixed"`
    every source is padded with pad_id to max_source_length first, so that every target starts at the same
    position (the slot is the known part of the row): a target token then sits at a fixed distance from the
    source token it copies, which attention with relative positions (RoPE) finds at once, where the released
    layout ("packed") makes the model find the source's end first. Returns
    "ids" (B, L) long, "source_mask" (B, L) bool (position < source length), "valid" (B, L) bool
    (position < unpadded length) and "encoder_mask" (B, L, L) bool (see `encoder_mask`).
    """
    if len(sources) != len(targets):
        raise ELFError(f"pair_layout: {len(sources)} sources but {len(targets)} targets")
    if not 0 < max_source_length < length:
        raise ELFError(f"the source length {max_source_length} must be between 1 and the sequence length "
                       f"{length} - 1, so that a target fits")
    check_source_slot(source_slot)
    n = len(sources)
    ids = torch.full((n, length), int(pad_id), dtype=torch.long)
    src_len = torch.empty(n, dtype=torch.long)
    row_len = torch.empty(n, dtype=torch.long)
    for i, (src, tgt) in enumerate(zip(sources, targets)):
        head = list(src[:max_source_length])
        if source_slot == FIXED:
            head += [int(pad_id)] * (max_source_length - len(head))
        row = (head + list(tgt))[:length]
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        src_len[i] = len(head)
        row_len[i] = len(row)
    pos = torch.arange(length)[None, :]
    source_mask, valid = pos < src_len[:, None], pos < row_len[:, None]
    return {"ids": ids, "source_mask": source_mask, "valid": valid,
            "encoder_mask": encoder_mask(source_mask, valid)}
