"""The size check: before any work, an estimate of the peak memory of a whole call is compared with the memory
the device has available, and the counts that set time alone are held under bounds that no real use reaches.

API (bytes are Python ints: no size overflows)
    check_count(value, flag, limit, why, low=1, hint="") -> int
        an integer count in low..limit, else ELFError naming the flag (or the file a stored count comes from),
        the range and why the bound is there; check_sampling_steps(steps, flag="--steps") -> int is the one
        of sampler step counts (MAX_SAMPLING_STEPS); check_size(value, flag) -> int a size >= 1
    transformer_pass(batch, length, width, depth, heads, mlp, *, vocab, backward, ...) -> dict
        (a) a network pass's peak bytes by part (activations, attention, logits), no-grad or forward + backward
    elf_sampling(config, *, steps, batch_size, num, length, trajectory_steps, ...) -> Estimate
        (b) an ELF sampling call (elflow.generate.generate): its counts bounded, then its peak
    tensor(*shape, element=4), weights(params, copies), training_weights(params, largest), held(each, total),
    buffers(*sizes)
        (c) the bytes of tensors, of parameters (with gradients and optimiser states), of buffers made again
        and again (of one size, or each of its own); elf_params(config) and block_params(width, heads, mlp)
        count parameters by formula
    Estimate(what, flags, parts, hint), merge(*parts) -> dict
        one call's estimate: what it is, the flags that set its size, its parts in bytes (summed), what to do
    check_fits(estimate, device=None) -> Estimate
        ELFError in one line (the work, the flags, the estimate by part, the memory, what to do) when the
        estimate exceeds available_memory(device): on a CPU MemAvailable, within the process's cgroup and
        ulimit; on a GPU its free memory and what torch's allocator holds unused
    check_elf_sampling(config, *, steps, batch_size, num, ..., device=None) -> Estimate
        elf_sampling checked against the device; its docstring shows the calls from a loaded model
    check_toy(num, steps, clusters, layout="ring", device=None) -> Estimate
        `elflow toy`'s memory
    check_total(factors, limit, unit, why, hint) -> int
        a product of counts held under its bound, one line naming each factor: check_sweep(grid, num) (a sweep's
        cells x --num), check_seeds(seeds, num) (eval's --seeds x --num), check_previews(steps, every,
        sample_steps) (a training run's previews)
    elf_training(config, *, rows, length, ...) -> Estimate, check_training(cfg, shape, space, recipe, method,
        micro, device=None) -> Estimate
        (d) a training step's peak: weights, gradients, optimiser state, EMA, the activations at the
        micro-batch, the frozen encoder's and a distillation teacher's passes; check_training reads them from
        a run's set-up (elflow.train.set_up)

Example (a command's check, before it builds or writes anything):

    est = Estimate("training the judge", f"--batch-size {b} --context {n}", merge(
        {"weights and AdamW": training_weights(params, vocab * width)},
        transformer_pass(b, n, width, depth, heads, vocab=vocab, backward=True)), "choose a smaller --batch-size")
    check_fits(est, device)

How an estimate is made: every part is counted in fp32 (bf16 autocast needs less) and the parts are summed;
buffers made and freed again and again (a pass's activations, a step's gradients) count ALLOCATOR_SLACK times
their live bytes while they are under HEAP_BLOCK, as an allocator keeps freed blocks for reuse and cannot always
fill the holes between them; one large buffer (logits, a draw) counts once. tests/util/test_budget.py measures the
peak RSS of calls in fresh processes: each estimate lies between 1 and 2.25 times it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from elflow.util.devices import human_bytes, resolve_dtype
from elflow.util.errors import ELFError

FLOAT = 4  # bytes of an fp32 element: every estimate counts in fp32
LONG = 8  # bytes of an int64 (token ids)
DOUBLE = 8  # bytes of a float64 element (a sampler's categorical weights and their CDF)
ALLOCATOR_SLACK = 2.0  # buffers made and freed again and again: peak RSS / live tensor bytes measured 1.2-1.8
HEAP_BLOCK = 32 * 2**20  # glibc's largest heap block: larger ones are mapped apart and go back when freed

# Bounds of counts that set time (and, through buffers of their size, memory), each far past real use. They are
# checked first, so that a mistyped count is refused at once, whatever memory the machine has.
MAX_SAMPLING_STEPS = 10_000  # the released recipe samples with at most 64 steps, its distillation teacher with 64
MAX_SAMPLES = 10_000_000  # the paper scores 5,000 samples per setting; samples are kept until written
MAX_TRAINING_STEPS = 100_000_000  # ELF-B trains 95,000 optimiser steps (1,000 times fewer)
MAX_BATCH = 1_048_576  # rows of an optimiser step: the paper's batch is 512; the memory check bounds it
MAX_LENGTH = 1_048_576  # positions of a sequence: the paper's longest is 1,088 (XSum); the memory check bounds it
MAX_ITERATIONS = 100_000  # a benchmark times a few iterations after a few more of warm-up (defaults 3 and 1)
MAX_MICRO_BATCHES = 65_536  # gradient accumulation: ELF-B's 512 rows in micro-batches of one row take 512
MAX_THREADS = 4_096  # CPU threads: the largest machines have a few hundred cores
MAX_MATMUL_SIZE = 65_536  # the matmul peak's square side: 2,048 on a CPU and 8,192 on a GPU by default
MAX_DRAWS = 1_000_000_000  # Monte-Carlo draws of a schedule: 200,000 give its statistics to three decimals
# Bounds of products of counts, each factor within its own bound: the work of a whole command
MAX_PREVIEW_PASSES = 2_000_000  # a run's previews, in network passes of one row: ELF-B's 95,000 steps previewed
# every 1,000 steps with 64 sampling steps of 2 samples take 12,160
PREVIEW_SAMPLES = 2  # the samples of each preview (elflow.train.show_samples)
BF16_SHARE = 0.75  # a bf16-autocast training step's activations and logits, against their fp32 bytes: measured
# 0.6 on an H200 (ELF-B at L = 1024: 0.74 GiB a row, 1.23 GiB counted in fp32); logits keep two fp32 copies of four
# (limit, why) of the counts several commands take, for check_count and cli.common.check_counts
SAMPLES_BOUND = (MAX_SAMPLES, "the paper scores 5,000 samples per setting")
TRAINING_STEPS_BOUND = (MAX_TRAINING_STEPS, "ELF-B trains 95,000 steps")
LENGTH_BOUND = (MAX_LENGTH, "the paper's longest sequence is 1,088 positions")

TRAINING_COPIES = 4  # buffers of a step the size of the largest tensor: a tied table's second gradient, the sum
FIGURE_BYTES = 32 * 2**20  # a matplotlib figure's canvas and artists: measured 26 MiB (Figure 2), 11 MiB (Figure 1)
PLOT_LINE_BYTES = 16_000  # one line drawn in a figure: measured 11 KB
RECORD_BYTES = 1_000  # a sample's record (dict, index, settings) before its text
BATCH_BYTES = 200  # the description of one batch of samples (its number, first index, rows and seed)
TEXT_BYTES_PER_TOKEN = 32  # a sample's text: a token decodes to a few characters, a str holds up to 4 bytes each
TRAJECTORY_BYTES_PER_TOKEN = 400  # one recorded step of one row, per position: ids, shown positions and text as
# Python lists (8-byte pointers to 28-byte ints), then the trajectory's JSON document and its page


# ----------------------------------------------------------------------------------------------------------
# counts
def check_count(value, flag: str, limit: int, why: str, low: int = 1, hint: str = "") -> int:
    """`value` as an int in low..limit; ELFError otherwise: one line with the flag (or where a stored value comes
    from), the range, `why` the bound is there and what to do. A float (a count read from JSON) must be whole;
    NaN, infinities, booleans and strings are refused."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok and isinstance(value, float):
        ok = math.isfinite(value) and value.is_integer()
    if ok and low <= value <= limit:
        return int(value)
    shown = f"{value:,}" if ok else repr(value)
    raise ELFError(f"{flag} must be an integer from {low:,} to {limit:,} ({why}), got {shown}"
                   + (f"; {hint}" if hint else ""))


def check_size(value, flag: str, low: int = 1) -> int:
    """A size (a width, a length, a batch) as an int >= low; its upper bound is the memory check's."""
    return check_count(value, flag, 2**62, "its memory is checked against the device's", low)


# ----------------------------------------------------------------------------------------------------------
# estimates
def tensor(*shape: int, element: int = FLOAT) -> int:
    """Bytes of one tensor of this shape (Python ints: no overflow, whatever the sizes)."""
    n = element
    for s in shape:
        n *= int(s)
    return n


def held(each: int, total: int) -> int:
    """The memory that buffers of `each` bytes, `total` in all at their peak, take from the machine when they
    are freed and made again (a pass's activations, a step's gradients): ALLOCATOR_SLACK times their bytes,
    as an allocator keeps freed blocks for reuse and cannot always fill the holes between them; once with
    buffers over HEAP_BLOCK, which go back to the system when freed."""
    return int(total if each > HEAP_BLOCK else ALLOCATOR_SLACK * total)


def buffers(*sizes: int) -> int:
    """The memory that buffers of these sizes (bytes), live together and made again at each step, take from
    the machine: each counted by its own size, `held` (a float64 copy of an fp32 buffer can be mapped apart
    where the fp32 one stays in the heap)."""
    return sum(held(n, n) for n in sizes)


def weights(params: int, copies: int = 1) -> int:
    """Bytes of `params` fp32 parameters held `copies` times (weights, gradients, optimiser states, an EMA)."""
    return FLOAT * int(params) * copies


def training_weights(params: int, largest: int) -> int:
    """Bytes of the parameters of a network trained with AdamW, `largest` the element count of its largest
    tensor: the weights and AdamW's two states, made once; the gradients, and TRAINING_COPIES buffers of the
    largest tensor's size (a tied table's second gradient and their sum, the update's temporaries), made
    again at every step and so `held`."""
    return weights(params, 3) + held(FLOAT * largest, weights(params) + weights(largest, TRAINING_COPIES))


def block_params(width: int, heads: int, mlp: int | None = None) -> int:
    """Parameters of one of elflow's transformer blocks (elflow.model.Block): qkv and output projections with
    biases, QK-norms, two RMSNorms, the SwiGLU's projections with biases."""
    mlp = int(width * 8 // 3) if mlp is None else mlp
    return 4 * width * width + 4 * width + 2 * (width // heads) + 2 * width + 3 * width * mlp + 2 * mlp + width


def elf_params(config) -> int:
    """The parameters and buffers (RoPE tables) of an ELF network of `config` (an ELFConfig: the released network
    with the short-run options off), by formula: no network is built, so any size is counted at once."""
    c = config
    H, C, V, b, depth = c.hidden, c.dim, c.vocab_size, c.bottleneck, c.depth
    mlp = getattr(c, "mlp_hidden", int(H * 8 // 3))
    n = (2 * C * C + C if getattr(c, "self_cond", True) else 0) + C * b + b * H + H
    n += 2 * (256 * H + H + H * H + H)  # the t and omega embedders
    if getattr(c, "conditioning", "tokens") == "adaln":
        n += H + depth * (6 * H * H + 6 * H) + 2 * H * H + 2 * H
    else:
        n += (c.time_tokens + c.omega_tokens + c.mode_tokens) * H
    n += depth * block_params(H, c.heads, mlp) + H + H * C + C  # the blocks, the final norm, the x head
    n += 2 * (c.max_length + getattr(c, "num_prefix", 12)) * (H // c.heads)  # RoPE's cos and sin
    head = H * C + C + C * V + V  # the decode head: a separate decoder's alone
    return (2 * n if getattr(c, "decoder", "shared") == "separate" else n) + head


def transformer_pass(batch: int, length: int, width: int, depth: int, heads: int, mlp: int | None = None, *,
                     vocab: int = 0, logit_rows: int | None = None, logit_length: int | None = None,
                     backward: bool = False, gated: bool = True, eager_attention: bool = False,
                     saved: int | None = None, gpu: bool = False) -> dict:
    """The peak bytes of one pass of a pre-norm transformer over `batch` rows of `length` positions (prefix
    tokens included), by part:

    activations: no-grad, one block's live buffers at a time: the residual stream, its normed copy and the
        MLP's (3 x width + 4 x mlp per token: the gated MLP's two projections in one, its activation and
        product; 2 x mlp ungated), or the attention's (10 x width); with `backward`, what each block keeps
        for the backward pass (`saved` elements per token; elflow's block keeps 14 x width + 4 x mlp) and one
        block's buffers besides. `held`: ALLOCATOR_SLACK times, below HEAP_BLOCK (on a `gpu`, whose
        allocator caches blocks of every size, once).
    attention: one block's score matrix (batch x heads x length^2), what attention without a fused kernel
        holds at a time (none on a `gpu`, whose fused kernels keep no scores); `eager_attention` (attention
        written out, as T5's): its scores, probabilities and position bias, kept by every block for the
        backward pass.
    logits: `logit_rows` (default: batch) x `logit_length` (default: length) x `vocab` in fp32; with
        `backward` the log-softmax, its gradient and the logits' gradient too (four copies).
    BLAS workspace: on a CPU, what the BLAS may hold while it computes the logits (`blas_workspace`).
    """
    mlp = int(width * 8 // 3) if mlp is None else mlp
    tokens = batch * length
    block = max(3 * width + (4 if gated else 2) * mlp, 10 * width)
    saved = 14 * width + 4 * mlp if saved is None else saved
    per_token = depth * saved + block if backward else block
    scores = tensor(batch, heads, length, length)
    attention = (3 * depth if backward else 3) * scores if eager_attention else 0 if gpu else scores
    rows = batch if logit_rows is None else logit_rows
    logits = tensor(rows, length if logit_length is None else logit_length, vocab) * (4 if backward else 1)
    live = FLOAT * tokens * per_token
    return {"activations": live if gpu else held(tensor(tokens, width), live), "attention": attention,
            "logits": logits, "BLAS workspace": 0 if gpu or not vocab else blas_workspace(width, vocab)}


def blas_workspace(k: int, n: int) -> int:
    """What a CPU BLAS may hold while it multiplies rows by a (k, n) fp32 weight, the readout's: it depends on
    the processor (MKL packs its operands in blocks sized for the instruction set it picks: 11 MB measured for
    1,024 rows by (384, 30,522) on an AVX512-BF16 EPYC, none with MKL_CBWR=COMPATIBLE; on an AMX Xeon that
    readout's peak was 18 MB above an estimate without it). Counted as the larger: one copy of the weight."""
    return tensor(k, n)


@dataclass(frozen=True)
class Estimate:
    """The estimated peak memory of one call: `what` it is, the `flags` that set its size (as the user wrote
    them, "--batch 8 --length 64"), its `parts` in bytes and the `hint` of what to do when it does not fit."""

    what: str
    flags: str
    parts: dict = field(default_factory=dict)
    hint: str = "choose smaller sizes"

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))

    def describe(self) -> str:
        shown = [f"{k} {size(v)}" for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1]) if v > 0]
        return f"about {size(self.total)} ({', '.join(shown[:5])})"


def size(n: int) -> str:
    """Bytes in words: "1.5 GiB"; past 1,024 PiB in powers of ten of PiB ("5.7e+10 PiB")."""
    return human_bytes(n) if n < 2**60 else f"{n / 2**50:.2g} PiB"


def merge(*parts: dict) -> dict:
    """Parts summed by name. The parts of a call are summed, not the largest taken: the buffers one pass frees
    stay with the allocator while the next pass makes its own (measured: the decode pass's logits come on top of
    what the sampling passes left)."""
    out: dict = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0) + int(v)
    return out


# ----------------------------------------------------------------------------------------------------------
# the memory of a device
def _machine_file(root: str, path: str) -> str | None:
    """The text of one of the machine's small files (/proc, /sys/fs/cgroup) under `root`; None where it cannot
    be read."""
    try:
        with open(os.path.join(root, path.lstrip("/"))) as f:
            return f.read(1 << 20)
    except (OSError, UnicodeDecodeError):
        return None


def _keyed(text: str | None) -> dict:
    """'key value [kB]' lines (/proc/meminfo with ':' after the key, memory.stat without) -> {key: bytes}."""
    out = {}
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
    return out


def _number(text: str | None) -> int | None:
    """A cgroup limit or usage file's number; None for 'max', an unreadable file or a limit past any machine."""
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) < 2**60 else None


def _cgroup_dirs(root: str) -> list[tuple[str, str]]:
    """The folders of this process's own memory cgroups, from /proc/self/cgroup placed by /proc/self/mountinfo
    (a cgroup v2 tree, or v1's memory hierarchy), innermost first, each up to its mount's top (a parent's limit
    binds too): [(folder, "v1" or "v2")]."""
    mounts = []  # (fstype, mounted cgroup path, mount point, super options)
    for line in (_machine_file(root, "/proc/self/mountinfo") or "").splitlines():
        head, _, tail = line.partition(" - ")
        head, tail = head.split(), tail.split()
        if len(head) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            mounts.append((tail[0], head[3], head[4], tail[2].split(",")))
    found = []
    for line in (_machine_file(root, "/proc/self/cgroup") or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
        if version is None:  # a v1 hierarchy of another controller
            continue
        for fstype, top, point, opts in mounts:
            if not (fstype == "cgroup2" if version == "v2" else fstype == "cgroup" and "memory" in opts):
                continue  # another hierarchy than this line's
            rel = os.path.relpath(path, top) if path.startswith(top) else None
            if rel is None or rel.startswith(".."):
                continue
            levels = [] if rel == "." else rel.split("/")
            found += [(os.path.join(point, *levels[:n]), version) for n in range(len(levels), -1, -1)]
            break
    return found


CGROUP_FILES = {"v2": ("memory.max", "memory.current"), "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}


def _cgroup_left(root: str) -> int | None:
    """Bytes the tightest of this process's memory cgroups can still give: its limit less what it uses, the
    reclaimable page cache (inactive_file) counted as free as the kernel does; None where no limit is set."""
    left = []
    for folder, version in _cgroup_dirs(root):
        cap, used = (_number(_machine_file(root, os.path.join(folder, f))) for f in CGROUP_FILES[version])
        if cap is None or used is None:
            continue
        stat = _keyed(_machine_file(root, os.path.join(folder, "memory.stat")))
        cache = stat.get("inactive_file", stat.get("total_inactive_file", 0))
        left.append(max(cap - max(used - cache, 0), 0))
    return min(left) if left else None


def _cpu_available(root: str = "/") -> tuple[int | None, str]:
    """Bytes of RAM this process can still take: the machine's MemAvailable (which counts reclaimable page cache
    as free), within what its own cgroups (v1 or v2, /proc/self/cgroup) leave and within its address-space and
    data limits; None where none of them can be read. `root`: where /proc and /sys are (a test's crafted tree)."""
    found = []
    info = _keyed(_machine_file(root, "/proc/meminfo"))
    if "MemAvailable" in info:
        found.append((info["MemAvailable"], "available on this machine"))
    cgroup = _cgroup_left(root)
    if cgroup is not None:
        found.append((cgroup, "left under this process's memory limit (cgroup)"))
    try:
        import resource

        status = _keyed(_machine_file(root, "/proc/self/status"))
        for rlimit, key in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
            soft = resource.getrlimit(rlimit)[0]
            if soft != resource.RLIM_INFINITY and key in status:
                found.append((max(soft - status[key], 0), "left under this process's memory limit (ulimit)"))
    except (ImportError, OSError, ValueError):
        pass
    if not found:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "on this machine"
        except (ValueError, OSError, AttributeError):
            return None, ""
    return min(found)


def available_memory(device=None) -> tuple[int | None, str]:
    """(bytes this process can still allocate on `device`, where in words); (None, "") where unknown. A GPU:
    its free memory plus what torch's allocator holds unused; a CPU: `_cpu_available`."""
    if device is not None and str(device).startswith("cuda"):
        try:
            import torch

            dev = torch.device(device)
            free, _ = torch.cuda.mem_get_info(dev)
            cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            return int(free + cached), f"free on {dev}"
        except (RuntimeError, AssertionError, ValueError, ImportError):
            return None, ""
    return _cpu_available()


def check_fits(estimate: Estimate, device=None) -> Estimate:
    """ELFError when `estimate` needs more memory than `device` has available (one line: the work, the flags
    that set its size, the estimate by part, the memory, what to do); the estimate otherwise."""
    have, where = available_memory(device)
    if have is not None and estimate.total > have:
        raise ELFError(f"{estimate.what} at {estimate.flags} needs {estimate.describe()}, more than the "
                       f"{size(have)} of memory {where}; {estimate.hint}")
    return estimate


# ----------------------------------------------------------------------------------------------------------
# an ELF sampling call
def check_sampling_steps(steps, flag: str = "--steps") -> int:
    """A sampler's step count in 1..MAX_SAMPLING_STEPS (ELFError otherwise): an ELF sampling call's, a
    distillation teacher's (--teacher-steps), a training run's previews (--sample-steps), a stored model's."""
    return check_count(steps, flag, MAX_SAMPLING_STEPS, "the released recipe samples with at most 64 steps")


def elf_sampling(config, *, steps: int, batch_size: int, num: int, length: int | None = None,
                 trajectory_steps: int = 0, guided: bool = False, table_readout: bool = False, params: int = 0,
                 flags: dict | None = None) -> Estimate:
    """The estimate of `generate` (elflow.generate) on an ELF network: the counts are checked first (steps in
    1..MAX_SAMPLING_STEPS, num in 1..MAX_SAMPLES, trajectory_steps in 0..steps), then its peak is estimated:
    the network's no-grad pass at the batch (twice as many rows' worth of sampler buffers when `guided`: a
    conditional model sampled with guidance != 1), the decode pass's logits (twice with `table_readout`), the
    sampler's z / x / noise and velocity buffers, the time grid of steps + 1, the records of `num` samples, and
    the first batch's readouts at `trajectory_steps` recorded steps. `params`: the network's parameter count
    when it is not in memory yet (0 once it is loaded: its weights are then already taken).

    `config` is the network's ELFConfig (or anything with depth, hidden, heads, dim, vocab_size, max_length;
    num_prefix and mlp_hidden are read where present). `flags` names where each count comes from, for the
    message: keys steps, batch_size, num, length, trajectory_steps (default --steps, --batch, --num, --length,
    --trajectory; None leaves a count out of the message); a value read from a stored model is named by its
    file ("steps in m/sampling.json")."""
    flags = flags or {}
    steps = check_sampling_steps(steps, flags.get("steps", "--steps"))
    trajectory_steps = check_count(trajectory_steps, flags.get("trajectory_steps", "--trajectory"), steps,
                                   "the steps of the sampling", low=0)
    if flags.get("num", "--num"):  # (a call that keeps no samples names none: its batch is its size)
        num = check_count(num, flags.get("num", "--num"), MAX_SAMPLES,
                          "the paper scores 5,000 samples per setting; the samples are kept until written")
    batch = check_size(batch_size, flags.get("batch_size", "--batch"))
    length = check_size(config.max_length if length is None else length, flags.get("length", "--length"))
    rows = min(batch, num)
    prefix = getattr(config, "num_prefix", 12)
    mlp = getattr(config, "mlp_hidden", None)
    C, V, H = config.dim, config.vocab_size, config.hidden
    trunk = transformer_pass(rows, length + prefix, H, config.depth, config.heads, mlp)
    decode = {"logits": tensor(rows, length, V) * (2 if table_readout else 1) + tensor(rows, length, element=LONG),
              "decode head": tensor(rows, length + prefix, H) + 2 * tensor(rows, length, C),
              "BLAS workspace": blas_workspace(C, V)}
    kept = {"weights": weights(params),
            "sampler buffers": held(tensor(rows, length, C), (2 if guided else 1) * 6 * tensor(rows, length, C))
            + tensor(steps + 1),
            "samples": num * (RECORD_BYTES + TEXT_BYTES_PER_TOKEN * length) + num // batch * BATCH_BYTES,
            "trajectory": trajectory_steps * rows * length * (TRAJECTORY_BYTES_PER_TOKEN + LONG)}
    names = [("steps", steps), ("batch_size", batch), ("num", num), ("length", length)]
    default = {"steps": "--steps", "batch_size": "--batch", "num": "--num", "length": "--length"}
    given = [(flags.get(k, default[k]), v) for k, v in names if flags.get(k, default[k])]
    # a flag as written (--steps 8); a count that no flag gave, named by where it comes from (its stored field)
    stored = any(not name.startswith("-") for name, _ in given)
    shown = (", " if stored else " ").join(f"{name} {v}" if name.startswith("-") else f"{name} = {v}"
                                           for name, v in given)
    if trajectory_steps:
        shown += f" ({trajectory_steps} recorded steps)"
    return Estimate("sampling", shown, merge(kept, trunk, decode), "choose a smaller batch (--batch), fewer samples "
                    "(--num), a shorter --length or fewer recorded steps")


def check_elf_sampling(config, *, steps: int, batch_size: int, num: int, length: int | None = None,
                       trajectory_steps: int = 0, guided: bool = False, table_readout: bool = False,
                       params: int = 0, flags: dict | None = None, device=None) -> Estimate:
    """`elf_sampling`'s counts and estimate checked against the memory of `device`: call it before the first
    sample is drawn (for a network not loaded yet, pass its parameter count). From a loaded model:

        from elflow.util.budget import check_elf_sampling
        net = loaded.net                                  # an ELF; net.config is its ELFConfig
        check_elf_sampling(net.config, steps=settings.steps, batch_size=settings.batch_size, num=args.num,
                           length=args.length, trajectory_steps=len(known.get("trajectory", ())),
                           guided=loaded.conditional and settings.guidance != 1, device=device)

    A count read from a stored model (a model folder's sampling.json) is named by where it comes from, and a
    flag of another name by its own (train's previews):

        check_elf_sampling(net.config, steps=settings.steps, ..., flags={"steps": "steps in m/sampling.json"})
        check_elf_sampling(config, steps=record.sampling.steps, batch_size=n, num=n, params=elf_params(config),
                           flags={"steps": "--sample-steps", "num": "--sample-num"}, device=device)

    A distillation teacher's steps alone: check_sampling_steps(args.teacher_steps, "--teacher-steps")."""
    return check_fits(elf_sampling(config, steps=steps, batch_size=batch_size, num=num, length=length,
                                   trajectory_steps=trajectory_steps, guided=guided, table_readout=table_readout,
                                   params=params, flags=flags), device)


# ----------------------------------------------------------------------------------------------------------
# products of counts
def check_total(factors, limit: int, unit: str, why: str, hint: str) -> int:
    """The product of `factors` ((text, count) pairs, each count already within its own bound: "2,000 --omega
    values", "--num 10,000") when it is at most `limit`; ELFError otherwise, one line naming every factor, the
    product in `unit`s, the bound, `why` it is there and what to do."""
    total = 1
    for _, n in factors:
        total *= int(n)
    if total > limit:
        shown = " x ".join(text for text, _ in factors)
        raise ELFError(f"{shown} make {total:,} {unit}, more than {limit:,} ({why}); {hint}")
    return total


def check_previews(steps: int, every: int, sample_steps: int, samples: int = PREVIEW_SAMPLES) -> int:
    """The network passes of a training run's previews (`steps` // `every` previews of `samples` samples drawn
    in `sample_steps` steps: the model's default sampling steps, --sample-steps where given) within
    MAX_PREVIEW_PASSES; none when `every` is 0."""
    if not every:
        return 0
    previews = int(steps) // int(every)
    return check_total([(f"{previews:,} previews (--steps {steps:,} / --sample-every {every:,})", previews),
                        (f"--sample-steps {sample_steps:,}", sample_steps), (f"{samples} samples", samples)],
                       MAX_PREVIEW_PASSES, "network passes of one row",
                       "previews watch a run: ELF-B's 95,000 steps previewed every 1,000 take 12,160",
                       "choose a larger --sample-every or a smaller --sample-steps (0 for --sample-every: none)")


def check_sweep(grid: dict, num: int) -> int:
    """The samples of a sweep (its cells, the product of the values of each axis of `grid`, {flag name: values},
    times --num), within MAX_SAMPLES."""
    factors = [(f"{len(v):,} --{k.replace('_', '-')} values", len(v)) for k, v in grid.items()]
    return check_total(factors + [(f"--num {num:,}", num)], MAX_SAMPLES, "samples",
                       "the paper's sweeps score 5,000 samples in each of a few dozen cells; every sample is drawn "
                       "and judged", "sweep fewer values, or choose a smaller --num")


def check_seeds(seeds: int, num: int) -> int:
    """The samples of an evaluation over `seeds` seeds of --num samples each, within MAX_SAMPLES."""
    return check_total([(f"{seeds:,} --seeds", seeds), (f"--num {num:,}", num)], MAX_SAMPLES, "samples",
                       "the paper scores 5,000 samples per setting and seed; every sample is drawn and judged",
                       "pass fewer --seeds, or a smaller --num")


# ----------------------------------------------------------------------------------------------------------
# a training step
def flagged_rows(rows: int, share: float) -> int:
    """The most rows of `rows` that a per-row draw with probability `share` picks in practice: the mean and three
    standard deviations, within 0..rows."""
    share = min(max(float(share), 0.0), 1.0)
    mean = rows * share
    return min(rows, math.ceil(mean + 3 * math.sqrt(mean * (1 - share)))) if share else 0


def encoder_pass(encoder, rows: int, length: int) -> int:
    """The peak bytes of a frozen encoder's no-grad pass over `rows` x `length` tokens, its shape read from its
    Hugging Face config (T5's or BERT's names); its attention is counted written out (scores, probabilities
    and position bias)."""
    c = getattr(encoder, "config", None)
    width = getattr(c, "d_model", None) or getattr(c, "hidden_size", None)
    if not width:
        return 0
    depth = getattr(c, "num_layers", None) or getattr(c, "num_hidden_layers", 1)
    heads = getattr(c, "num_heads", None) or getattr(c, "num_attention_heads", 1)
    mlp = getattr(c, "d_ff", None) or getattr(c, "intermediate_size", None) or 4 * width
    return sum(transformer_pass(rows, length, width, depth, heads, mlp, gated=False,
                                eager_attention=True).values())


def elf_training(config, *, rows: int, length: int, trainable: int = 0, decode_share: float = 0.2,
                 self_cond_share: float = 0.5, checkpointing: bool = False, tangents: bool = False,
                 logits_everywhere: bool = False, adamw: bool = False, previews: bool = False, encoder: int = 0,
                 teacher=None, teacher_weights: int = 0, gpu: bool = False, bf16: bool = False,
                 what: str = "training", flags: str = "") -> Estimate:
    """The estimate of one training step of the network of `config` (an ELFConfig, or anything with depth,
    hidden, heads, dim, vocab_size; a token baseline is sized to it) at `rows` rows of `length` positions:

    weights, optimiser state (two moments at most), gradients and the update's temporaries, the EMA, and with
    `previews` the network the previews sample with; the trained pass's saved activations (per block only its
    input with `checkpointing`; twice with forward-mode `tangents`), its logits on `decode_share` of the rows
    (on every row and position for `logits_everywhere`), the flow's per-token buffers, the no-grad
    self-conditioning pass on `self_cond_share` of the rows, `encoder` (the frozen encoder's pass, bytes), the
    no-grad pass of a `teacher` (its config) and `teacher_weights`, the bytes of its weights not taken yet.
    `trainable` counts the parameters trained beside the network (a learned table); on a `gpu` no allocator
    slack and no attention scores (`transformer_pass`); under `bf16` autocast the passes' buffers and logits
    count BF16_SHARE of their fp32 bytes; `what` and `flags` name the work in the message."""
    c = config
    H, C, V, depth = c.hidden, c.dim, c.vocab_size, c.depth
    mlp = getattr(c, "mlp_hidden", int(H * 8 // 3))
    prefix = 0 if logits_everywhere else getattr(c, "num_prefix", 12)
    params = elf_params(c)
    largest = max(C * V, 2 * mlp * H)
    trained = params + int(trainable)
    saved = 14 * H + 4 * mlp
    if checkpointing:  # each block keeps its input; one block's buffers are made again in the backward pass
        saved = H + math.ceil(saved / depth)
    decode = rows if logits_everywhere else flagged_rows(rows, decode_share)
    step = transformer_pass(rows, length + prefix, H, depth, c.heads, mlp, vocab=V, logit_rows=decode,
                            logit_length=length, backward=True, saved=saved, gpu=gpu)
    step["activations"] *= 2 if tangents else 1
    guess = transformer_pass(flagged_rows(rows, self_cond_share), length + prefix, H, depth, c.heads, mlp, gpu=gpu)
    slack = (lambda each, total: total) if gpu else held
    parts = {"weights": weights(params + trainable), "optimiser state": weights(trained, 2),
             "gradients and update": slack(FLOAT * largest, weights(trained, 2 if adamw else 1)
                                           + weights(largest, TRAINING_COPIES)),
             "EMA": weights(params), "previews": weights(params) if previews else 0,
             "flow buffers": slack(tensor(rows, length, C), 12 * tensor(rows, length, C)),
             "self-conditioning pass": sum(guess.values()), "frozen encoder": int(encoder)}
    if teacher is not None:
        t = teacher
        passes = transformer_pass(rows, length + prefix, t.hidden, t.depth, t.heads, getattr(t, "mlp_hidden", None),
                                  gpu=gpu)
        parts["teacher"] = sum(passes.values())
    if bf16:
        for name, part in (("activations", step), ("logits", step), ("self-conditioning pass", parts),
                           ("teacher", parts)):
            if name in part:
                part[name] = int(part[name] * BF16_SHARE)
    parts["teacher"] = parts.get("teacher", 0) + int(teacher_weights)
    return Estimate(what, flags, merge(parts, step), _training_hint(parts, step))


def _training_hint(parts: dict, step: dict) -> str:
    """What to do about a training step that does not fit: a smaller network where its own state (weights,
    gradients, optimiser state, EMA) is most of the estimate, else a smaller micro-batch or length."""
    own = sum(parts[k] for k in ("weights", "optimiser state", "gradients and update", "EMA", "previews"))
    if 2 * own >= sum(parts.values()) + sum(step.values()):
        return (f"the network's weights, gradients, optimiser state and EMA alone take {size(own)}: choose a "
                "smaller --preset (or --depth / --hidden)")
    return ("choose a smaller --micro-batch (the batch is then accumulated) or a shorter --length; "
            "--grad-checkpoint keeps less of each block")


def check_training(cfg, shape, space, recipe, method, micro: int, device=None) -> Estimate:
    """A training step's memory checked against `device`, before its network is built: `cfg` the run's
    TrainConfig, `shape` the ELF network's config, `space` the embedding space (built: its frozen encoder's
    weights are taken already, its pass is counted), `recipe` the flow recipe, `method` the training method (a
    distillation's holds its `teacher`, loaded), `micro` the rows of a forward/backward pass."""
    trainable = sum(p.numel() for p in space.parameters() if p.requires_grad) if hasattr(space, "parameters") else 0
    encoder = getattr(space, "encoder", None)
    teacher = getattr(method, "teacher", None)
    length = cfg.length or shape.max_length
    flags = (f"--preset {cfg.preset} (depth {shape.depth}, hidden {shape.hidden}) --batch {cfg.batch}"
             + (f" --micro-batch {micro}" if micro != cfg.batch else ""))
    est = elf_training(shape, rows=micro, length=length, trainable=trainable, decode_share=recipe.decode_prob,
                       self_cond_share=recipe.self_cond_prob, checkpointing=bool(cfg.grad_checkpoint),
                       tangents=getattr(method, "tangents", False),
                       logits_everywhere=getattr(method, "logits_everywhere", False),
                       adamw=cfg.optimizer == "adamw", previews=bool(cfg.sample_every),
                       encoder=encoder_pass(encoder, micro, length) if encoder is not None else 0,
                       teacher=getattr(teacher, "config", None), **precision(device, cfg.dtype),
                       flags=f"{flags} --length {length}")
    return check_fits(est, device)


def precision(device, dtype: str) -> dict:
    """elf_training's `gpu` and `bf16` for a run on `device` (None: the CPU) in `dtype` (a run's --dtype)."""
    gpu = device is not None and str(device).startswith("cuda")
    return {"gpu": gpu, "bf16": resolve_dtype(dtype, device if device is not None else "cpu") == "bf16"}


# ----------------------------------------------------------------------------------------------------------
# the toy
def check_toy(num: int, steps, clusters: int, layout: str = "ring", device=None) -> Estimate:
    """`elflow toy`'s memory (its counts are bounded by its command, elflow.cli.toy): for each step count, the
    path and the guesses of every sample (steps + 1 points of 2 coordinates), the exact denoiser's
    (num x clusters) float64 buffers, and one line per sample in each panel of the figure."""
    k = clusters * clusters if layout == "grid" else clusters
    paths = sum(2 * tensor(n + 1, num, 2) for n in steps)
    denoiser = {"denoiser": held(tensor(num, k, 2, element=LONG), 6 * tensor(num, k, 2, element=LONG))}
    kept = {"paths": paths, "figure": FIGURE_BYTES + PLOT_LINE_BYTES * num * len(steps),
            "clusters": tensor(k, 2, element=LONG)}
    flags = f"--num {num} --steps {' '.join(map(str, steps))} --clusters {clusters}"
    return check_fits(Estimate("the toy", flags, merge(kept, denoiser),
                               "choose a smaller --num, fewer --steps or fewer --clusters"), device)