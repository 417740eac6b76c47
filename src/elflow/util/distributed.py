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
