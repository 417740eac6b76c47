"""Small shared helpers: settings records, atomic file writes, output checks, folder locks, devices and the
process group, float64 categorical draws."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, fields, replace
from pathlib import Path


__all__ = ["ELFError", "Record", "atomic_write", "atomic_write_text", "atomic_write_json", "default_device", "sha256_file",
           "cache_root", "cpu_flags", "fast_bf16", "resolve_dtype", "autocast", "check_device", "check_output", "FolderLock",
           "setup_distributed", "process_group", "DIST_TIMEOUT_MINUTES", "use_tf32", "distributed", "on_rank0", "on_every_rank",
           "sample_categorical"]


class ELFError(Exception):
    """An error caused by the user's input: printed as one clear message, without a traceback."""


class Record:
    """The serialisation of a settings dataclass: `to_dict`, `from_dict` (missing keys take their defaults,
    unknown ones are a ValueError naming them) and `replace`."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {unknown}")
        return cls(**d)

    def replace(self, **kw):
        return replace(self, **kw)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb"):
    """Open a temporary file next to `path`; on success rename it over `path`, on error remove it.

    A reader never sees a half-written file, and a crash leaves the previous version intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def default_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """elflow's cache folder: `cache_dir`, else $ELFLOW_CACHE, else ~/.cache/elflow."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("ELFLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "elflow"


def sample_categorical(weights, generator=None):
    """One draw per row of `weights` (..., V): non-negative, not necessarily normalised. Returns (...) ids.

    Inverse CDF in float64: u ~ U[0, 1) scaled by the row's total, the first index whose cumulative weight
    exceeds it. A zero-weight id is never drawn. Float64 matters: the float32 Gumbel-max trick
    (argmax of log p + Gumbel noise, with u in float32) truncates the Gumbel tail, so low-probability ids are
    drawn too rarely: samples lose entropy and their generative perplexity looks better than the model's.
    """
    import torch

    cdf = weights.to(torch.float64).cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), dtype=torch.float64, generator=generator, device=cdf.device)
    total = cdf[..., -1:].contiguous()
    ids = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the last id of positive weight (u * total may round up)
    return torch.minimum(ids, last).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------
# devices and precision


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none); read once per process."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def fast_bf16(device) -> bool:
    """Whether bf16 matmuls are fast on this device: GPUs, and CPUs with AMX or AVX512-BF16."""
    import torch

    if torch.device(device).type == "cuda":
        return True
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def resolve_dtype(dtype: str, device) -> str:
    """"auto" -> bf16 on GPUs and CPUs with native bf16 matmuls (AMX, AVX512-BF16), fp32 elsewhere."""
    return ("bf16" if fast_bf16(device) else "fp32") if dtype == "auto" else dtype


def autocast(device, dtype: str):
    """A bf16 autocast context when `dtype` is (or "auto" resolves to) bf16 on `device`, else no context."""
    import contextlib

    import torch

    device = torch.device(device)
    if resolve_dtype(dtype, device) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_device(device: str | None, flag: str = "--device") -> str | None:
    """A --device value that this machine can use (None: the default); ELFError otherwise."""
    if device is None:
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ELFError(f"{flag} {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ELFError(f"{flag} {device}: CUDA is not available here ({why}); use --device cpu or leave "
                           "--device out")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ELFError(f"{flag} {device}: there are only {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ELFError(f"{flag} {device!r}: elflow runs on cpu or cuda")
    return str(dev)


# ----------------------------------------------------------------------------------------------------------
# the process group


DIST_TIMEOUT_MINUTES = 180.0  # how long a rank waits for the others in a collective, unless told otherwise


def setup_distributed(device: str | None = None, timeout_minutes: float | None = None):
    """(rank, world_size, local_rank, device) from torchrun's environment, or a single process on `device`
    (default: cuda when available). The process group's collectives wait `timeout_minutes` (default
    DIST_TIMEOUT_MINUTES) for the slowest rank before they fail."""
    import datetime

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    wants_cpu = device is not None and torch.device(device).type == "cpu"
    if world > 1:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if dist.is_initialized():  # a caller that runs several trainings (distillation's rounds) holds the group
            gpu = dist.get_backend() == "nccl"
            return rank, world, local, torch.device("cuda", local) if gpu else torch.device("cpu")
        timeout = datetime.timedelta(minutes=timeout_minutes or DIST_TIMEOUT_MINUTES)
        if torch.cuda.is_available() and not wants_cpu:
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
            dist.init_process_group("nccl", device_id=dev, timeout=timeout)
        else:
            dev = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
        return rank, world, local, dev
    return 0, 1, 0, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


@contextmanager
def process_group(device: str | None = None, timeout_minutes: float | None = None):
    """`with process_group(device) as (rank, world, device)`: a command's ranks under torchrun (the process
    group set up here, if no caller holds one, and torn down at the end), or one process on `device`."""
    import torch.distributed as dist

    owns = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    rank, world, _, dev = setup_distributed(device, timeout_minutes)
    try:
        yield rank, world, dev
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()


def use_tf32(device, enabled: bool) -> None:
    """On a CUDA device, fp32 matmuls in TF32 (`enabled`) or in full fp32; CPUs are left as they are. Set
    through `allow_tf32`, which keeps torch's global precision consistent with it (torch.compile reads that
    one; setting the CUDA backend's alone makes reading the global an error)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(enabled)


def distributed() -> tuple[int, int]:
    """(rank, world size) of the process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def on_rank0(fn, rank: int, world: int):
    """Run `fn` on rank 0 only and return its result on every rank (a picklable object); if it failed there,
    every rank raises (rank 0 its own error, the others an ELFError with its message), so that no rank waits
    for it forever."""
    import torch.distributed as dist

    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised below, after the other ranks are told)
            error = e
    if world > 1:
        box = [(result, None if error is None else str(error) or type(error).__name__)]
        dist.broadcast_object_list(box, src=0)
        result, message = box[0]
        if message is not None and error is None:
            raise ELFError(f"rank 0 stopped: {message}")
    if error is not None:
        raise error
    return result


def on_every_rank(fn, rank: int, world: int):
    """Run `fn` on every rank and return its result; if it raised an ELFError on any rank, every rank raises
    one naming the first such rank and its host, so that all stop together with the same message."""
    import torch.distributed as dist

    result, message = None, None
    try:
        result = fn()
    except ELFError as e:
        message = str(e)
    if world > 1:
        told = [None] * world
        dist.all_gather_object(told, (rank, socket.gethostname(), message))
        failed = [t for t in told if t[2] is not None]
        if failed:
            r, host, msg = failed[0]
            raise ELFError(f"rank {r} (host {host}): {msg}")
    elif message is not None:
        raise ELFError(message)
    return result


# ----------------------------------------------------------------------------------------------------------
# output paths


def _probe_writable(folder: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".elflow-probe-", dir=folder)
    os.close(fd)
    os.unlink(tmp)


def check_output(path: str | os.PathLike, overwrite: bool = False, flag: str = "--out",
                 folder: bool = False) -> Path:
    """Refuse an output path before any work is done: an existing file (unless `overwrite`), a folder where a
    file is wanted (or the reverse), a path under a regular file, a place that cannot be written.
    A folder output may exist; what may be replaced inside it is the command's decision."""
    path = Path(path).expanduser()
    if path.exists():
        if folder and not path.is_dir():
            raise ELFError(f"{flag} {path} is a file, not a folder; choose another {flag}")
        if not folder:
            if path.is_dir():
                raise ELFError(f"{flag} {path} is a folder; pass a file name")
            if not overwrite:
                raise ELFError(f"{flag} {path} already exists; pass --overwrite to replace it, or choose another "
                               f"{flag}")
    base = path if folder and path.is_dir() else path.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ELFError(f"{flag} {path} lies under {base}, which is a file, not a folder; choose another {flag}")
    try:
        _probe_writable(base)
    except OSError as e:
        raise ELFError(f"{flag} {path}: cannot write in {base} ({e.strerror or e}); choose a writable place") from None
    return path


def no_space_error(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


# ----------------------------------------------------------------------------------------------------------
# a folder's lock


class FolderLock:
    """An exclusive hold on a folder: `.lock`, created with O_EXCL, holding pid, host and command.

    A lock whose process no longer runs on this host (a killed command) is stale and taken over."""

    NAME = ".lock"

    def __init__(self, folder: str | os.PathLike, command: str):
        self.path = Path(folder) / self.NAME
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "time": time.time()}
        self.held = False

    def _holder(self) -> dict | None:
        try:
            info = json.loads(self.path.read_text())
            return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None
        except (OSError, ValueError):
            return None

    def _stale(self, holder: dict | None) -> bool:
        if holder is None:  # empty or garbled: a holder killed while writing it, unless it is being written now
            try:
                return time.time() - self.path.stat().st_mtime > 10
            except FileNotFoundError:
                return True
        if holder.get("host") != self.info["host"]:
            return False  # another machine's process: cannot be checked from here
        pid = holder["pid"]
        if pid == os.getpid():
            return True  # this process's own leftover
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def acquire(self) -> "FolderLock":
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if self._stale(holder):
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
                    continue
                who = (f"pid {holder['pid']} on {holder.get('host')}: {holder.get('command', '?')}" if holder
                       else "a process that is starting")
                raise ELFError(f"{self.path.parent} is in use by another elflow command ({who}); wait for it to "
                               f"finish, or, if it no longer runs, delete {self.path}") from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.info) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return self
        raise ELFError(f"cannot take the lock {self.path}: other commands keep taking it")

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            if holder is not None and holder.get("pid") == self.info["pid"]:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            self.held = False


# ----------------------------------------------------------------------------------------------------------
# the Hugging Face Hub


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE asks for the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


@functools.lru_cache(maxsize=None)
def hub_reachable(timeout: float = 3.0) -> bool:
    """One cheap connection test per process, so that a machine without a network fails at once instead of
    after the hub clients' retries (about 50 s)."""
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # the proxy decides; let the client try
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_local_only(local: bool = False) -> bool:
    """`local_files_only` for a from_pretrained call: a local folder, HF_HUB_OFFLINE, or no network."""
    return local or hub_offline() or not hub_reachable()


def hub_unavailable_reason() -> str | None:
    """Why the hub cannot be asked (None when it can)."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    if not hub_reachable():
        return ("no network: the Hugging Face Hub cannot be reached from here (set HF_HUB_OFFLINE=1 to use the "
                "local cache without this check)")
    return None
