"""Devices and precision: the default device, bf16 where it is fast (GPUs, CPUs with AMX / AVX512-BF16),
autocast, TF32, flushed CPU denormals, and sizes in words (the memory check is elflow.util.budget.check_fits)."""

from __future__ import annotations

import functools
from contextlib import contextmanager

from elflow.util.errors import ELFError


def default_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


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


def device_name(device) -> str:
    """A device in words: "cuda:0 (NVIDIA H100 80GB HBM3)", "cpu (AMD EPYC 7B13, 2 threads)"."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    import platform

    model = model or platform.processor() or platform.machine()
    return f"cpu ({model}, {torch.get_num_threads()} threads)"


AUTOCAST_DTYPES = ("fp32", "bf16")  # the precisions a forward pass runs in
RUN_DTYPES = ("auto", *AUTOCAST_DTYPES)  # a run's: "auto" picks one by the device (`resolve_dtype`)


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


def use_tf32(device, enabled: bool) -> None:
    """On a CUDA device, fp32 matmuls in TF32 (`enabled`) or in full fp32; CPUs are left as they are. Set
    through `allow_tf32`, which keeps torch's global precision consistent with it (torch.compile reads that
    one; setting the CUDA backend's alone makes reading the global an error)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(enabled)


@contextmanager
def flushed_denormals():
    """Inside the block, CPU float results below the normal range (|x| < 1.2e-38) are flushed to zero, and
    the previous setting comes back at the end (GPUs are not affected). Denormals run through a
    CPU's slow microcoded path: a readout's log-softmax gradient over a 30,522-token vocabulary holds about
    680,000 of them per step once the readout is confident (probabilities below e^-87), and the matmuls that
    read it slowed a demo training step from 0.97 to 1.80 s on an Intel Xeon (benchmarks/RESULTS.md). No
    value that training keeps is that small, so flushing them changes nothing that is measured."""
    import torch

    was = bool((torch.tensor(1e-39) * 1.5).item() == 0.0)  # the current setting, which torch has no getter for
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"
