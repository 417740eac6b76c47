"""The process group under torchrun (NCCL on GPUs, Gloo on CPUs) and the two ways a decision is shared: rank 0
decides for all (`on_rank0`), or every rank checks and all stop together (`on_every_rank`)."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager

from elflow.util.errors import ELFError

# ----------------------------------------------------------------------------------------------------------
# the process group
DIST_TIMEOUT_MINUTES = 180.0  # how long a rank waits for the others in a collective, unless told otherwise
DIST_TIMEOUT_MAX = 7 * 24 * 60.0  # a week
DIST_TIMEOUT_HELP = ("minutes a rank waits for the others under torchrun (for the group to form, and in each "
                     "collective) before the job fails with one line")
ONE_PROCESS = "unset WORLD_SIZE, RANK and LOCAL_RANK to run in one process"
TORCHRUN = f"start every rank with torchrun (`torchrun --nproc_per_node N -m elflow.cli ...`), or {ONE_PROCESS}"
GATHER = ("every rank must start within that time: start them all with torchrun, with the same --master-addr and "
          "--master-port on every node, or give a longer --dist-timeout")


def check_dist_timeout(minutes, flag: str = "--dist-timeout") -> float:
    """A timeout in minutes a process group can wait: a number in (0, DIST_TIMEOUT_MAX]; ELFError naming
    `flag` otherwise."""
    import math

    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not math.isfinite(minutes) \
            or not 0 < minutes <= DIST_TIMEOUT_MAX:
        raise ELFError(f"{flag} must be a number of minutes in (0, {DIST_TIMEOUT_MAX:,.0f}] (a week), got {minutes!r}")
    return float(minutes)


def _whole(env, name: str, low: int, high: int | None = None, default: int | None = None,
           world: int | None = None) -> int:
    """The torchrun variable `name` of `env` as a whole number from `low` to `high`; `default` where unset."""
    raw = env.get(name, "").strip()
    if not raw:
        if default is not None:
            return default
        raise ELFError(f"WORLD_SIZE={world} asks for a torchrun group of {world} processes, but {name} is not set: "
                       f"this process was not started by torchrun; {TORCHRUN}")
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ELFError(f"{name}={raw!r} is not a whole number {span}; torchrun sets it for each process it starts: "
                       f"{TORCHRUN}")
    return value


def world_size(env=None) -> int:
    """WORLD_SIZE of `env` (the environment by default), checked (1 where it is unset): the number of
    processes torchrun started."""
    return _whole(os.environ if env is None else env, "WORLD_SIZE", 1, default=1)


def torchrun_env(env=None) -> tuple[int, int, int, str, int] | None:
    """(rank, world size, local rank, MASTER_ADDR, MASTER_PORT) of a process torchrun started, from `env` (the
    environment by default), each variable checked; None for one process (WORLD_SIZE unset or 1, whatever else
    is set). ELFError naming the variable that is missing or is not what torchrun sets."""
    env = os.environ if env is None else env
    world = world_size(env)
    if world == 1:
        return None
    rank = _whole(env, "RANK", 0, world - 1, world=world)
    local = _whole(env, "LOCAL_RANK", 0, world - 1, default=0)
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        raise ELFError(f"WORLD_SIZE={world} asks for a torchrun group of {world} processes, but MASTER_ADDR is not "
                       f"set: this process was not started by torchrun; {TORCHRUN}")
    port = _whole(env, "MASTER_PORT", 1, 65535, world=world)
    return rank, world, local, addr, port


def _reach_rank0(addr: str, port: int, rank: int, world: int, seconds: float) -> None:
    """Wait up to `seconds` for rank 0's rendezvous at addr:port to accept a connection (torch's own client
    retries in C++ and fills the terminal with its logs); ELFError when the name does not resolve or nothing
    answers in time."""
    import socket
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except socket.gaierror as e:
            raise ELFError(f"MASTER_ADDR={addr}: no such host ({e.strerror or e}); on several nodes, give every "
                           f"node rank 0's address (torchrun --master-addr), or {ONE_PROCESS}") from None
        except OSError:
            if time.monotonic() >= deadline:
                raise ELFError(f"rank {rank} of WORLD_SIZE={world}: nothing answered at MASTER_ADDR={addr} "
                               f"MASTER_PORT={port} within --dist-timeout {seconds / 60:g} minutes (rank 0 never "
                               f"started, or another address or port); {GATHER}") from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def interruptible(fn):
    """fn() in a helper thread while the calling thread waits for it in short slices, so that SIGTERM and Ctrl-C
    stop the command at once: a rendezvous waits inside torch's C++ code, where Python runs no signal handler
    until it returns (up to --dist-timeout later). fn's result, or its exception raised here."""
    import threading

    done = {}

    def work():
        try:
            done["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (raised again in the waiting thread)
            done["error"] = e

    helper = threading.Thread(target=work, name="elflow-rendezvous", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.2)
    if "error" in done:
        raise done["error"]
    return done.get("value")


def _join(backend: str, env, minutes: float, **kw) -> None:
    """init_process_group under torchrun's variables `env`, bounded by `minutes`; one ELFError when the group
    does not form (a rank that never comes, a port in use)."""
    import datetime

    import torch.distributed as dist

    rank, world, _, addr, port = env
    if rank > 0:
        _reach_rank0(addr, port, rank, world, minutes * 60)

    def form():
        if "device_id" in kw:  # the current GPU is the calling thread's own
            import torch

            torch.cuda.set_device(kw["device_id"])
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=minutes), **kw)

    try:
        interruptible(form)
    except (RuntimeError, ValueError) as e:  # torch's DistError family, a bad rendezvous value
        text = " ".join(str(e).split())[:200]
        taken = "address already in use" in text.lower()
        hint = f"another program holds port {port} on this host: choose another --master-port" if taken else GATHER
        raise ELFError(f"rank {rank} of WORLD_SIZE={world}: the torchrun group did not form at MASTER_ADDR={addr} "
                       f"MASTER_PORT={port} within --dist-timeout {minutes:g} minutes ({type(e).__name__}: {text}); "
                       f"{hint}") from None


def setup_distributed(device: str | None = None, timeout_minutes: float | None = None):
    """(rank, world_size, local_rank, device) from torchrun's environment (`torchrun_env`), or a single process
    on `device` (default: cuda when available). The group forms, and its collectives wait, `timeout_minutes`
    (default DIST_TIMEOUT_MINUTES) for the slowest rank before they fail; a group that does not form in that
    time is one ELFError."""
    import torch
    import torch.distributed as dist

    env = torchrun_env()
    wants_cpu = device is not None and torch.device(device).type == "cpu"
    if env is None:
        return 0, 1, 0, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank, world, local = env[:3]
    if dist.is_initialized():  # a caller that runs several trainings (distillation's rounds) holds the group
        gpu = dist.get_backend() == "nccl"
        return rank, world, local, torch.device("cuda", local) if gpu else torch.device("cpu")
    minutes = check_dist_timeout(timeout_minutes or DIST_TIMEOUT_MINUTES)
    if torch.cuda.is_available() and not wants_cpu:
        if local >= torch.cuda.device_count():
            raise ELFError(f"LOCAL_RANK={local}, but this node has {torch.cuda.device_count()} GPU(s): start at most "
                           "that many processes per node (torchrun --nproc_per_node)")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        _join("nccl", env, minutes, device_id=dev)
    else:
        dev = torch.device("cpu")
        _join("gloo", env, minutes)
    return rank, world, local, dev


@contextmanager
def process_group(device: str | None = None, timeout_minutes: float | None = None):
    """`with process_group(device) as (rank, world, device)`: a command's ranks under torchrun (the process
    group set up here, if no caller holds one, and torn down at the end), or one process on `device`."""
    import torch.distributed as dist

    owns = world_size() > 1 and not dist.is_initialized()
    rank, world, _, dev = setup_distributed(device, timeout_minutes)
    try:
        yield rank, world, dev
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()


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


_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def peer_lost(e: BaseException) -> str:
    """What to say when `e` is a collective's failure because another process of the group died (Gloo's
    "Connection closed by peer"); "" for any other error."""
    text = str(e)
    if type(e).__module__.split(".")[0] != "torch" and "gloo" not in text.lower():
        return ""
    if not any(w in text.lower() for w in _PEER_WORDS):
        return ""
    return f"another rank of this torchrun group died ({text.split('] ', 1)[-1].split('. ')[0]})"


def raise_if_peer_lost(e: BaseException, world: int, rank: int, resume_command: str) -> None:
    """ELFError (one line on the surviving ranks) when `e` is a collective's failure because another rank of
    the group died, naming the command that resumes the run; nothing for any other error."""
    lost = peer_lost(e) if world > 1 else ""
    if lost:
        raise ELFError(f"rank {rank}: {lost}; this rank stops too. The run resumes from its last checkpoint "
                       f"with `{resume_command}` (on any number of ranks)") from None


def destroy_group(ok: bool) -> None:
    """Tear the process group down; a group whose peer died has nothing left to tear down, which only a run
    that ended well (`ok`) reports."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except RuntimeError:
        if ok:
            raise
