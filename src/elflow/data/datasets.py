"""The data sets a run reads: a text or pair store prepared once into the cache (by one process; the other
ranks wait), laid out in rows and split into training and held-out rows (`build_dataset`, `build_pairs`)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

from elflow.data.batches import split_rows
from elflow.data.corpus import BUILTIN_NAMES, _warn, check_on_bad, local_source
from elflow.data.ingest import prepare_store
from elflow.data.integrity import Fingerprint, check_source_fingerprint
from elflow.data.layout import LAYOUTS, PACKED, check_source_slot
from elflow.data.origins import origin_difference, origin_fingerprint
from elflow.data.store import StoreRows, TokenStore, file_lock, is_store
from elflow.util.distributed import distributed
from elflow.util.errors import ELFError
from elflow.util.files import cache_root, disk_full

STORE_KEY_VERSION = 1  # bump when what a cached store holds changes


PREPARE_TIMEOUT = timedelta(days=7)  # how long the other ranks wait for rank 0's preparation


# ----------------------------------------------------------------------------------------------------
# Stores in the cache, prepared once
def _cache_key(kind: str, source, space, options: dict, cache_dir) -> str:
    key = {"v": STORE_KEY_VERSION, "kind": kind, "source": origin_fingerprint(source, cache_dir),
           "tokenizer": space.tokenizer_id, "eos": space.eos_id, "pad": space.pad_id, **options}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _complete(folder: Path, warn: bool = False) -> TokenStore | None:
    if not (folder / "manifest.json").is_file():
        return None
    try:
        return TokenStore(folder)
    except ELFError as e:
        if warn:
            _warn(f"ignoring the damaged cached store {folder} ({e}); preparing it again")
        return None


def _cached(kind: str, source, space, options: dict, cache_dir, use_cache: bool) -> tuple[TokenStore, str]:
    """The cache's store of `source` (prepared now if missing: "miss", else "hit"), once across ranks."""
    def make():
        if not use_cache:
            tmp = Path(tempfile.mkdtemp(prefix="elflow-store-"))
            try:
                store = prepare_store(source, space, tmp, pairs=kind == "pairs", cache_dir=cache_dir, overwrite=True,
                                      advice="choose another temporary folder with TMPDIR", **options)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # the memory maps stay valid
            return store, "miss"
        root = cache_root(cache_dir) / "stores"
        folder = root / _cache_key(kind, source, space, options, cache_dir)
        store = _complete(folder)
        if store is not None:
            return store, "hit"
        advice = f"choose another cache folder than {root.parent} with --cache-dir or ELFLOW_CACHE"
        try:
            lock = file_lock(root / f"{folder.name}.lock")  # waits while another process prepares this store
        except OSError as e:
            full = "no space left on its device" if disk_full(e) else e.strerror or str(e)
            raise ELFError(f"the cache folder {root.parent} cannot be written ({full}), and the token store of "
                           f"{source} is to be prepared there; {advice}") from None
        try:
            store = _complete(folder, warn=True)
            if store is not None:
                return store, "hit"
            return prepare_store(source, space, folder, pairs=kind == "pairs", cache_dir=cache_dir, overwrite=True,
                                 advice=advice, **options), "miss"
        finally:
            lock.close()

    return _once_across_ranks(make)


def _once_across_ranks(make):
    """`make()` on rank 0 first, then on the other ranks, which wait for it on a Gloo group whose timeout is
    PREPARE_TIMEOUT; every rank raises if it failed anywhere. Without a process group: `make()`."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return make()
    group = dist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT)
    rank = dist.get_rank()
    result = None
    try:
        for turn in ("first", "then"):
            error = None
            if (rank == 0) == (turn == "first"):
                try:
                    result = make()
                except BaseException as e:  # noqa: BLE001 (re-raised below, after the other ranks know)
                    error = e
            flag = torch.tensor([0.0 if error is None else 1.0])
            dist.all_reduce(flag, group=group)
            if error is not None:
                raise error
            if flag.item():
                raise ELFError("another rank stopped while preparing the data (its message says why)")
        return result
    finally:
        dist.destroy_process_group(group)


def text_store(source, space, cache_dir=None, field: str = "text", on_bad: str = "stop", split: str = "train",
               max_documents: int | None = None, use_cache: bool = True) -> tuple[TokenStore, str]:
    """(store, "given" | "hit" | "miss"): `source` itself when it is a store folder (checked against the
    space's tokenizer), else its store in the cache, prepared once."""
    if is_store(source):
        store = TokenStore(source)
        store.check_space(space)
        return store, "given"
    options = {"field": field, "on_bad": on_bad, "split": split, "max_documents": max_documents}
    store, state = _cached("text", source, space, options, cache_dir, use_cache)
    return store, state


def pair_store(source, space, cache_dir=None, source_field: str = "input", target_field: str = "output",
               on_bad: str = "stop", split: str = "train", max_documents: int | None = None,
               use_cache: bool = True) -> tuple[TokenStore, str]:
    """Like `text_store`, for (source, target) pairs."""
    if is_store(source):
        store = TokenStore(source)
        store.check_space(space)
        return store, "given"
    options = {"source_field": source_field, "target_field": target_field, "on_bad": on_bad, "split": split,
               "max_documents": max_documents}
    return _cached("pairs", source, space, options, cache_dir, use_cache)


# ----------------------------------------------------------------------------------------------------
# Data sets read from stores
def _check_length(space, length: int) -> None:
    space.check_length(length)
    if length < 2:
        raise ELFError(f"sequence length must be at least 2, got {length}")


def _info(store: TokenStore, state: str, source, layout: str, length: int) -> dict:
    return {"source": str(source), "layout": layout, "length": length, "tokenizer": store.tokenizer_id,
            "records": store.count, "corpus_tokens": store.num_tokens, "cache": state, "store": str(store.folder)}


def build_dataset(source, space, length: int, layout: str = PACKED, val_fraction: float = 0.01, seed: int = 0,
                  cache_dir=None, field: str = "text", on_bad: str = "stop", split: str = "train",
                  max_documents: int | None = None, pad_in_loss: bool = True, use_cache: bool = True
                  ) -> tuple[StoreRows, StoreRows]:
    """(train, validation) rows of `length` tokens of a text source in `layout`, read from its store (the
    source itself when it is a store folder, else its store in the cache, prepared once); the validation rows
    are chosen at random from `seed` (`data.split_rows`)."""
    if layout not in LAYOUTS:
        raise ELFError(f"layout must be 'packed' or 'document', got {layout!r}")
    check_on_bad(on_bad)
    _check_length(space, length)
    store, state = text_store(source, space, cache_dir, field, on_bad, split, max_documents, use_cache)
    if store.kind != "text":
        raise ELFError(f"{source} holds (source, target) pairs; train on it with --source-length")
    if state == "given" and store.layout not in (None, layout) and distributed()[0] == 0:
        _warn(f"{source} was prepared for the {store.layout} layout; reading it as {layout} rows (--layout)")
    rows = StoreRows(store, layout, length, pad_in_loss, info=_info(store, state, source, layout, length))
    rows.info["sequences"] = len(rows)
    return split_rows(rows, val_fraction, seed)


def build_pairs(source, space, source_length: int = 64, length: int = 128, val_fraction: float = 0.01,
                seed: int = 0, cache_dir=None, source_field: str = "input", target_field: str = "output",
                on_bad: str = "stop", split: str = "train", max_documents: int | None = None,
                use_cache: bool = True, source_slot: str = PACKED) -> tuple[StoreRows, StoreRows]:
    """Conditional (source, target) rows (`data.pair_layout`): every row holds its source (cut to
    `source_length`), then its target right after it (at `source_length` with the "fixed" `source_slot`),
    EOS-padded to `length`; `known` marks the source. The
    loss covers every other position, the padding included (that is how the model learns where a target ends).

    source: a pair store, a .jsonl file of {source_field, target_field} records, a named task ("wmt14-de-en",
    "xsum") or a hub dataset name read with the same fields. In T5-small's space, a folder saved with
    `datasets.save_to_disk` or a hub set holding the released pre-tokenized columns (condition_input_ids /
    input_ids) is used as it is, and a named task reads the released pre-tokenized copy."""
    check_on_bad(on_bad)
    if not 0 < source_length < length:
        raise ELFError(f"the source length {source_length} must be between 1 and the sequence length "
                       f"{length} - 1, so that a target fits")
    _check_length(space, length)
    store, state = pair_store(source, space, cache_dir, source_field, target_field, on_bad, split, max_documents,
                              use_cache)
    if store.kind != "pairs":
        raise ELFError(f"{source} holds text, not (source, target) pairs: prepare pairs with --source-length, or "
                       "train on it without --source-length")
    check_source_slot(source_slot)
    rows = StoreRows(store, "pairs", length, source_length=source_length, fixed_slot=source_slot == "fixed",
                     info={**_info(store, state, source, "pairs", length), "source_length": source_length,
                           "source_slot": source_slot})
    rows.info.update(sequences=len(rows), pairs=len(rows))
    cut = rows.sources_cut()
    if cut and distributed()[0] == 0:
        _warn(f"{cut} of {len(rows)} sources are longer than {source_length} tokens and were cut "
              "(raise --source-length to keep more)")
    return split_rows(rows, val_fraction, seed)


def run_data(cfg, space, length: int, cache_dir=None):
    """(training split, held-out split) of a run's data (its settings `cfg`, an elflow.config.TrainConfig) in
    `space`: (source, target) pairs or text, rows read from the data's token store."""
    task = cfg.task
    if task is not None:
        return build_pairs(cfg.data, space, task.source_length, length, val_fraction=cfg.val_fraction,
                           seed=cfg.seed, cache_dir=cache_dir, source_field=task.source_field,
                           target_field=task.target_field, on_bad=cfg.on_bad, source_slot=task.source_slot)
    return build_dataset(cfg.data, space, length, layout=cfg.layout, val_fraction=cfg.val_fraction,
                         seed=cfg.seed, cache_dir=cache_dir, field=cfg.text_field, on_bad=cfg.on_bad)


# ----------------------------------------------------------------------------------------------------
# The store a run reads, recorded and checked on resume
RECORD_ADVICE = ("the checkpoint's record of its token store was changed or damaged: resume from another checkpoint, "
                 "or start a new run with --overwrite or another --out")


def store_record(rows) -> dict | None:
    """What a run records of the token store its rows are read from: the folder, the store's fingerprint and
    the fingerprint of the source the store was prepared from, the sha256 of its text included (None for rows
    held in memory)."""
    store = getattr(rows, "store", None)
    if store is None:
        return None
    source = (store.manifest.get("source") or {}).get("fingerprint")
    return {"folder": str(store.folder), "fingerprint": store.fingerprint.to_dict(),
            **({"source": source} if source is not None else {})}


def _recorded(recorded, where) -> tuple[Fingerprint | None, dict | None]:
    """(store fingerprint, source fingerprint) of a checkpoint's record `recorded` (`store_record`), checked
    field by field; (None, None) for a run recorded without one (an earlier elflow, rows held in memory)."""
    if recorded is None:
        return None, None
    if not isinstance(recorded, dict):
        raise ELFError(f"{where}: data_store is not an object; {RECORD_ADVICE}")
    fp = recorded.get("fingerprint")
    before = None if fp is None else Fingerprint.from_dict(fp, where, RECORD_ADVICE, "data_store.fingerprint")
    source = recorded.get("source")
    if source is not None:
        check_source_fingerprint(source, where, RECORD_ADVICE, "data_store.source")
    return before, source


def check_not_relative(source, recorded, where) -> None:
    """A run's --data `source` as a run recorded it before elflow wrote its paths absolute: a path relative to the
    folder it was trained in (which its record does not hold) that names nothing from here is one line saying
    so, not a lookup of its name on the hub. The checkpoint's record of its store (`store_record`) tells a
    local path from a hub name: a store given by that path, or a store prepared from local files."""
    text = str(source)
    if not isinstance(recorded, dict) or text in BUILTIN_NAMES or Path(text).expanduser().is_absolute():
        return
    if local_source(text) is not None:
        return
    folder, origin = recorded.get("folder"), recorded.get("source")
    if (isinstance(folder, str) and Path(folder) == Path(text)) or (isinstance(origin, dict) and "files" in origin):
        raise ELFError(f"{where} records --data {text!r}, a path relative to the folder the run was trained in, "
                       f"which the record does not hold, and {text!r} names nothing here: run from that folder, or "
                       "pass --data with its path from here")


def check_recorded_store(recorded, source, where) -> None:
    """Before a run's data `source` is read on resume: the token store folder the checkpoint (its state.json
    `where`) records, when the run was given one, must still be there; a missing one is one line naming it,
    not a lookup of its name on the hub. The record is checked field by field (`check_same_store` compares it
    once the data is read). A store in the cache (of a hub dataset) is prepared again as on a start. Local
    files whose count or size differ from the source the store was prepared from are refused here, before
    anything is read (a run.json whose --data was edited; a store folder is compared once it is read)."""
    _, before = _recorded(recorded, where)
    check_not_relative(source, recorded, where)
    local = local_source(source)
    if before is not None and (str(source) in BUILTIN_NAMES or local is not None and not is_store(local)):
        now = origin_fingerprint(source)
        a, b = ({k: fp.get(k) for k in ("builtin", "files", "bytes")} for fp in (before, now))
        if a != b:
            raise ELFError(f"--data {source} is not the data this run was trained on ({where} records "
                           f"{origin_difference(before, now)}); resume on the data the run started on, or start "
                           "a new run with --overwrite or another --out")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("folder"), str):
        return
    if str(source) in BUILTIN_NAMES or local_source(source) is not None:
        return
    folder = Path(recorded["folder"])
    if folder.parent.name == "stores" and re.fullmatch(r"[0-9a-f]{24}", folder.name):
        return
    raise ELFError(f"{source}: the token store this run was trained on ({where} records it as {folder}) is "
                   "missing; put it back, or prepare it again from the same text with `elflow prepare`, then "
                   "resume")


def check_same_store(recorded, rows, where) -> None:
    """Refuse to continue a run (recorded in `where`) on other data than it was trained on: the fingerprint
    `recorded` (`store_record`) must be the store's, and the source the store was prepared from must hold the
    same text (its sha256, where both record one: a store prepared again from an edited file is refused even
    where the sampled blocks are the same). A run recorded without one (an earlier elflow) is not checked;
    a record that is not one (a changed state.json) is refused field by field."""
    store = getattr(rows, "store", None)
    before, source = _recorded(recorded, where)
    if store is None or before is None:
        return
    now = store.fingerprint
    if (now.blocks, now.block_bytes) != (before.blocks, before.block_bytes):  # sampled otherwise then
        now = store.sampled(before.blocks, before.block_bytes)
    if before != now:
        raise ELFError(f"{store.folder} is not the token store this run was trained on ({where} records another: "
                       f"{before.difference(now)}); resume on the store the run started on, or start a new run "
                       "with --overwrite or another --out")
    current = (store.manifest.get("source") or {}).get("fingerprint")
    change = None if source is None or current is None else origin_difference(source, current)
    if change is not None:
        name = (store.manifest.get("source") or {}).get("name") or "the source"
        raise ELFError(f"{name} is not the text this run was trained on ({change}; {where} records the text as it "
                       f"was, and {store.folder} was prepared from it as it is now); resume on the data the run "
                       "started on, or start a new run with --overwrite or another --out")
