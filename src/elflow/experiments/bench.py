"""`elflow bench`: forward, training-step and sampling speed of a network against the device's matmul peak
(FLOP formulas of the released recipe)."""

from __future__ import annotations

import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from elflow.flow import Recipe, draw_training_noise
from elflow.methods import get_method
from elflow.methods.base import TrainedPass
from elflow.methods.elf import HEAD_PREFIXES
from elflow.model import ELF, PRESETS, ELFConfig, get_config
from elflow.newton_schulz import NS_METHODS, method_for
from elflow.optim import EMA, ELFOptimizer
from elflow.sampler import generate_tokens
from elflow.schedule import EMA_DECAY
from elflow.train import shard_generators, train_step
from elflow.util.budget import (
    FLOAT,
    LONG,
    MAX_ITERATIONS,
    MAX_MATMUL_SIZE,
    MAX_MICRO_BATCHES,
    MAX_THREADS,
    Estimate,
    check_count,
    check_fits,
    elf_params,
    elf_sampling,
    held,
    merge,
    tensor,
    transformer_pass,
    weights,
)
from elflow.util.devices import AUTOCAST_DTYPES, RUN_DTYPES, autocast, default_device
from elflow.util.errors import ELFError

MODES = ("forward", "train", "sample")


FLOP_FORMULA = ("pass/row = 2L(2C^2 + Cb + bH) + depth(2N(4H^2 + 3HM) + 4N^2 H) + 4(256H + H^2) + head "
                "[x: 2LHC; decode: 2L(HC + CV)], N = L + prefix; train: no-grad pass 1x, trained pass 3x, "
                "+ encoder forward + Newton-Schulz per Muon matrix [iterate: 5(4k^2 n + 2k^3); "
                "spectral: 4k^2 n + 11k^3]; sample: steps x pass + decode")


# ----------------------------------------------------------------------------------------------------------
# FLOP formulas
def pass_flops(c: ELFConfig, length: int, head: str = "x") -> int:
    """Model FLOPs of one network pass of one row: head "x" (denoise), "logits" (decode) or "none"."""
    L, N, H, C = length, length + c.num_prefix, c.hidden, c.dim
    f = 2 * L * ((2 * C * C if c.self_cond else 0) + C * c.bottleneck + c.bottleneck * H)
    f += c.depth * (2 * N * (4 * H * H + 3 * H * c.mlp_hidden) + 4 * N * N * H)
    f += 2 * 2 * (256 * H + H * H)  # t and omega embedders (sinusoid features of size 256)
    if head == "x":
        f += 2 * L * H * C
    elif head == "logits":
        f += 2 * L * (H * C + C * c.vocab_size)
    return f


def encoder_flops(space, length: int) -> int:
    """Forward FLOPs of the frozen encoder on one row: 2 x (weights in Linear layers) x L + 4 L^2 d per layer."""
    enc = getattr(space, "encoder", None)
    if enc is None:
        return 0
    lin = sum(m.weight.numel() for m in enc.modules() if isinstance(m, nn.Linear))
    cfg = enc.config
    inner = cfg.num_heads * cfg.d_kv
    return 2 * lin * length + 4 * length * length * inner * cfg.num_layers


def newton_schulz_flops(shapes, steps: int = 5, method: str = "iterate") -> int:
    """FLOPs of Muon's Newton-Schulz on matrices of these shapes (k, n = smaller, larger side):
    iterate steps x (4 k^2 n + 2 k^3); spectral 4 k^2 n + 2 k^3 + 9 k^3 (eigh counted as 9 k^3);
    by-shape: each matrix as elflow.newton_schulz.method_for evaluates it."""
    if method not in NS_METHODS[1:]:
        raise ValueError(f"method must be one of {', '.join(NS_METHODS[1:])}, got {method!r}")
    total = 0
    for m, n in shapes:
        k, n_ = min(m, n), max(m, n)
        if method_for((m, n), method) == "iterate":
            total += steps * (4 * k * k * n_ + 2 * k ** 3)
        else:
            total += 4 * k * k * n_ + 11 * k ** 3
    return total


def train_step_flops(c: ELFConfig, length: int, rows: int, sc_rows: int, dec_rows: int) -> dict:
    """ELF FLOPs of elflow's recipe on one micro-batch: one no-grad pass on the self-conditioned rows, then
    one trained pass (3x) on every row, with the decode head on the decode rows."""
    fx, fhead = pass_flops(c, length, "x"), pass_flops(c, length, "logits") - pass_flops(c, length, "none")
    return {"selfcond_pass": sc_rows * fx, "trained_pass": 3 * (rows * fx + dec_rows * fhead)}


def reference_recipe_flops(c: ELFConfig, length: int, decode_prob: float = Recipe.decode_prob,
                           self_cond_prob: float = Recipe.self_cond_prob) -> dict:
    """Expected ELF FLOPs per training token, of elflow's recipe and of the reference listing.

    Reference listing, per denoising row: the x0 pass always, the xs pass on self-conditioned rows, then
    the trained pass (3x); decode rows: the trained pass with the decode head (3x).
    elflow: the x0 pass only on self-conditioned rows, the xs pass reused from the trained pass.
    """
    fx, fl = pass_flops(c, length, "x"), pass_flops(c, length, "logits")
    den, sc = 1 - decode_prob, self_cond_prob
    ref = den * ((1 + sc) * fx + 3 * fx) + decode_prob * 3 * fl
    ours = den * (sc * fx + 3 * fx) + decode_prob * 3 * fl
    return {"reference_per_token": ref / length, "elflow_per_token": ours / length, "ratio": ours / ref,
            "forward_pass_per_token": fx / length}


# ----------------------------------------------------------------------------------------------------------
# the device's own peak
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device, min_time: float = 0.5, min_iters: int = 3) -> float:
    s = time.perf_counter()
    fn()
    _sync(device)
    if time.perf_counter() - s > min_time:  # one call is already long (bf16 on AVX2: a minute): time one more
        min_iters = 1
    best, n, t0 = float("inf"), 0, time.perf_counter()
    while n < min_iters or time.perf_counter() - t0 < min_time:
        s = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - s)
        n += 1
    return best


@torch.no_grad()
def matmul_peak(device, dtype: torch.dtype, size: int | None = None, min_time: float = 0.5) -> dict:
    """Best measured GEMM rate (FLOP/s) of a size x size x size product, as `a @ b` and as `F.linear`.

    CPUs without native bf16 units run `a @ b` in bf16 through a slow reference kernel but F.linear through
    oneDNN; the faster of the two is the peak (the network's matmuls are linears).
    """
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 2048)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.float32, generator=g).to(dtype)
    b = torch.randn(size, size, device=device, dtype=torch.float32, generator=g).to(dtype)
    flops = 2 * size ** 3
    mm = flops / _best_time(lambda: a @ b, device, min_time)
    lin = flops / _best_time(lambda: F.linear(a, b), device, min_time)
    return {"flops_per_s": max(mm, lin), "op": "matmul" if mm >= lin else "linear", "size": size,
            "dtype": str(dtype).replace("torch.", ""), "matmul_flops_per_s": mm, "linear_flops_per_s": lin}


# ----------------------------------------------------------------------------------------------------------
# a stand-in embedding space
class StandInSpace(nn.Module):
    """A randomly initialised encoder of the real space's shape (same cost), outputs divided by 0.2.

    dim 512: T5-small's encoder (6 layers, d_ff 2048, 8 heads). Other dims: a 6-layer T5-style encoder
    of that width (MiniLM-L6-like cost) when dim >= 256, a 1-layer one below.
    """

    def __init__(self, dim: int, vocab_size: int, max_length: int, device=None):
        super().__init__()
        from transformers import T5Config, T5EncoderModel

        if dim == 512:
            cfg = T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                           feed_forward_proj="relu", dropout_rate=0.0)
        else:
            heads = max(1, dim // 64)
            cfg = T5Config(vocab_size=max(vocab_size, 8), d_model=dim, d_kv=dim // heads, d_ff=4 * dim,
                           num_layers=6 if dim >= 256 else 1, num_heads=heads, feed_forward_proj="relu",
                           dropout_rate=0.0)
        self.encoder = T5EncoderModel(cfg).to(device).eval().requires_grad_(False)
        self.dim, self.vocab_size, self.max_length = dim, vocab_size, max_length

    trainable = False  # frozen, like the real encoder

    @torch.no_grad()
    def encode(self, tokens, attention_mask=None, source_len=None, drop_source=None):
        return self.encoder(input_ids=tokens, attention_mask=attention_mask).last_hidden_state / 0.2


class NoSpace(nn.Module):
    """Zero-cost space: fixed random embeddings (isolates the ELF network's cost)."""

    def __init__(self, dim: int, vocab_size: int, max_length: int, device=None):
        super().__init__()
        self.dim, self.vocab_size, self.max_length = dim, vocab_size, max_length
        self.table = torch.randn(vocab_size, dim, device=device)

    trainable = False  # nothing here learns, so train_step encodes under no_grad as for a frozen encoder

    def encode(self, tokens, attention_mask=None, source_len=None, drop_source=None):
        return self.table[tokens]


# ----------------------------------------------------------------------------------------------------------
# the benchmarks
def _peak_memory(device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"


def _timed(fn, device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


class _Timer:
    """Accumulates synced wall time per phase (for the training-step breakdown)."""

    def __init__(self, device):
        self.device, self.seconds = device, {}

    def wrap(self, name, fn):
        def timed(*a, **k):
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            _sync(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            return out
        return timed


class _TimedNet(nn.Module):
    """Forwards to the network, timing the self-conditioning pass (forward) and the trained pass (mixed)."""

    def __init__(self, net, timer):
        super().__init__()
        self.net, self.timer = net, timer

    def forward(self, *a):
        return self.timer.wrap("selfcond_pass", self.net)(*a)

    def mixed(self, *a):
        return self.timer.wrap("trained_pass_forward", self.net.mixed)(*a)


def _standin_shape(dim: int, vocab_size: int) -> tuple[int, int, int]:
    """(vocabulary, layers, heads) of StandInSpace's encoder for an embedding width `dim`."""
    if dim == 512:
        return 32128, 6, 8
    return max(vocab_size, 8), 6 if dim >= 256 else 1, max(1, dim // 64)


def check_bench(mode: str, preset: str, cfg: ELFConfig, batch: int, length: int, steps: int, iters: int, warmup: int,
                accum: int, peak_size: int, space: str, device) -> Estimate:
    """Refuse, before anything is built, iteration counts past any real use and a benchmark whose memory exceeds
    what `device` has available: the network's weights, the matmul peak's operands, and the timed work (a
    no-grad pass; a sampling call; a training step with its optimiser states, EMA, stand-in encoder, a
    self-conditioning pass and a trained pass with every row's logits)."""
    why = "a benchmark times a few iterations after a few more of warm-up"
    check_count(iters, "--iters", MAX_ITERATIONS, why)
    check_count(warmup, "--warmup", MAX_ITERATIONS, why, low=0)
    check_count(accum, "--accum", MAX_MICRO_BATCHES, "ELF-B's 512 rows in micro-batches of one row take 512")
    check_count(peak_size, "--peak-size", MAX_MATMUL_SIZE, "the defaults are 2,048 on a CPU and 8,192 on a GPU")
    B, L, N = batch, length, length + cfg.num_prefix
    H, C, V = cfg.hidden, cfg.dim, cfg.vocab_size
    flags = (f"--batch {B} --length {L} (--preset {preset}: depth {cfg.depth}, hidden {H}, heads {cfg.heads}, "
             f"vocab size {V})")
    net = FLOAT * elf_params(cfg)
    parts = {"weights": net, "matmul peak": 4 * tensor(peak_size, peak_size)}
    if mode == "forward":
        work = merge({"inputs": 4 * tensor(B, L, C)}, transformer_pass(B, N, H, cfg.depth, cfg.heads, cfg.mlp_hidden))
    elif mode == "sample":
        est = elf_sampling(cfg, steps=steps, batch_size=B, num=B, length=L, flags={"num": None})
        work, flags = est.parts, est.flags + flags[flags.index(" ("):]
    else:
        enc_vocab, layers, enc_heads = _standin_shape(C, V)
        largest = max(V * C, 2 * cfg.mlp_hidden * H, 3 * H * H) * FLOAT
        work = merge(
            {"optimiser and EMA": weights(net // FLOAT, 4) + held(largest, net + 4 * largest),
             "encoder": 0 if space == "none" else FLOAT * (enc_vocab * C + layers * 12 * C * C),
             "tokens": tensor(accum, B, L, element=LONG)},
            transformer_pass(B, N, H, cfg.depth, cfg.heads, cfg.mlp_hidden),  # self-conditioning, no grad
            transformer_pass(B, N, H, cfg.depth, cfg.heads, cfg.mlp_hidden, vocab=V, logit_length=L, backward=True),
            {} if space == "none" else transformer_pass(B, L, C, layers, enc_heads, 4 * C, gated=False,
                                                        eager_attention=True))
        flags = flags.replace("--length", f"--accum {accum} --length")
    return check_fits(Estimate(f"bench {mode}", flags, merge(parts, work), "choose a smaller --batch, --length or "
                               "--peak-size, or a smaller network (--depth, --hidden, --vocab-size)"), device)


def bench(mode: str, preset: str = "tiny", depth=None, hidden=None, heads=None, length=None, batch: int = 4,
          steps: int = 32, dtype: str = "fp32", compile: bool = False, device=None, warmup: int = 1,
          iters: int = 3, accum: int = 1, space: str = "standin", grad_checkpoint: bool = False,
          adam_heads: bool = False, ns_dtype: str = "auto", ns_method: str = "auto", peak_size: int | None = None,
          breakdown: bool = False, seed: int = 0, threads: int | None = None,
          vocab_size: int | None = None) -> dict:
    """Run one benchmark and return its record (its fields: docs/performance.md)."""
    _check_args(mode, preset, dtype, batch, iters, accum, steps, warmup, peak_size, space, ns_dtype, ns_method)
    if threads:  # (0 or None: torch's own count)
        torch.set_num_threads(check_count(threads, "--threads", MAX_THREADS, "more threads than cores only slow it"))
    device = torch.device(device or default_device())
    L = PRESETS[preset].max_length if length is None else length
    if L < 1:
        raise ELFError(f"--length must be >= 1, got {L}")
    try:
        cfg = get_config(preset, depth=depth, hidden=hidden, heads=heads, vocab_size=vocab_size,
                         max_length=max(L, PRESETS[preset].max_length))
    except ValueError as e:
        raise ELFError(str(e)) from e
    peak_size = peak_size or (8192 if device.type == "cuda" else 2048)
    B = batch
    check_bench(mode, preset, cfg, B, L, steps, iters, warmup, accum, peak_size, space, device)
    torch.manual_seed(seed)
    net = ELF(cfg).to(device)
    net.grad_checkpoint = grad_checkpoint
    model = torch.compile(net) if compile else net
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak = matmul_peak(device, torch.bfloat16 if dtype == "bf16" else torch.float32, peak_size)
    g = torch.Generator(device=device).manual_seed(seed)
    rec = {"mode": mode, "preset": preset, "config": cfg.to_dict(), "device": device.type,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "threads": torch.get_num_threads(), "dtype": dtype, "compile": compile, "batch": B, "length": L,
           "params": net.num_params(), "flop_formula": FLOP_FORMULA}
    timing = dict(device=device, dtype=dtype, warmup=warmup, iters=iters, g=g, B=B, L=L)
    if mode == "forward":
        times, tokens, flops, extra = _bench_forward(model, net, cfg, **timing)
    elif mode == "sample":
        times, tokens, flops, extra = _bench_sample(model, net, cfg, steps, **timing)
    else:
        times, tokens, flops, extra = _bench_train(net, cfg, space, accum, adam_heads, ns_dtype, ns_method, compile,
                                                   seed, breakdown, grad_checkpoint, **timing)
    mean = statistics.fmean(times)
    mem, mem_kind = _peak_memory(device)
    rec.update({
        "iterations": len(times), "warmup": warmup, "seconds_per_iter": mean, "seconds_per_iter_min": min(times),
        "tokens_per_iter": tokens, "tokens_per_s": tokens / mean,
        "flops_per_iter": flops, "flops_per_token": flops / tokens, "flops_per_s": flops / mean,
        "peak_flops_per_s": peak["flops_per_s"], "peak": peak,
        "utilisation": (flops / mean) / peak["flops_per_s"],
        "peak_memory_bytes": mem, "memory_kind": mem_kind,
    })
    rec.update(extra)
    return rec


def _check_args(mode, preset, dtype, batch, iters, accum, steps, warmup, peak_size, space, ns_dtype, ns_method):
    """`bench`'s settings, checked before anything is built (ELFError naming the first that is wrong)."""
    if mode not in MODES:
        raise ELFError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if preset not in PRESETS:
        raise ELFError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in AUTOCAST_DTYPES:
        raise ELFError(f"--dtype must be one of {', '.join(AUTOCAST_DTYPES)}, got {dtype!r}")
    for name, v in (("batch", batch), ("iters", iters), ("accum", accum), ("steps", steps)):
        if v < 1:
            raise ELFError(f"--{name} must be >= 1, got {v}")
    if warmup < 0:
        raise ELFError(f"--warmup must be >= 0, got {warmup}")
    if peak_size is not None and peak_size < 1:
        raise ELFError(f"--peak-size must be >= 1, got {peak_size}")
    if space not in ("standin", "none"):
        raise ELFError(f"--space must be standin or none, got {space!r}")
    if ns_dtype not in RUN_DTYPES:
        raise ELFError(f"--ns-dtype must be one of {', '.join(RUN_DTYPES)}, got {ns_dtype!r}")
    if ns_method not in NS_METHODS:
        raise ELFError(f"--ns-method must be one of {', '.join(NS_METHODS)}, got {ns_method!r}")


def _bench_forward(model, net, cfg, device, dtype, warmup, iters, g, B, L):
    """One denoising pass of a batch: (times, tokens, flops, extra fields)."""
    net.eval()
    C = cfg.dim
    z = torch.randn(B, L, C, device=device, generator=g)
    x_prev = torch.randn(B, L, C, device=device, generator=g)
    t, w = torch.rand(B, device=device, generator=g), torch.full((B,), 3.0, device=device)

    @torch.no_grad()
    def fn():
        with autocast(device, dtype):
            model(z, t, w, x_prev)
    times = _timed(fn, device, warmup, iters)
    flops = B * pass_flops(cfg, L, "x")
    return times, B * L, flops, {"flops_breakdown": {"network": flops}}


def _bench_sample(model, net, cfg, steps, device, dtype, warmup, iters, g, B, L):
    """Sampling a batch in `steps` steps and its readout: (times, tokens, flops, extra fields)."""
    net.eval()

    def fn():
        with autocast(device, dtype):
            generate_tokens(model, B, L, steps=steps, generator=g, device=device)
    times = _timed(fn, device, warmup, iters)
    flops = B * (steps * pass_flops(cfg, L, "x") + pass_flops(cfg, L, "logits"))
    extra = {"flops_breakdown": {"denoise_passes": B * steps * pass_flops(cfg, L, "x"),
                                 "decode_pass": B * pass_flops(cfg, L, "logits")}, "sampling_steps": steps}
    return times, B * L, flops, extra


def _bench_train(net, cfg, space, accum, adam_heads, ns_dtype, ns_method, compile, seed, breakdown, grad_checkpoint,
                 device, dtype, warmup, iters, g, B, L):
    """Optimiser steps of the trainer's own step function: (times, tokens, flops, extra fields), the FLOPs
    from the timed steps' actual draws (their self-conditioning and decode rows)."""
    sp = (StandInSpace if space == "standin" else NoSpace)(cfg.dim, cfg.vocab_size, L, device)
    net.train()
    recipe = Recipe()
    nsd = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}[ns_dtype]
    heads = [n for n, _ in net.named_parameters() if adam_heads and n.startswith(HEAD_PREFIXES)]
    opt = ELFOptimizer(list(net.named_parameters()), lr=1e-4, adam=heads, ns_dtype=nsd, ns_method=ns_method)
    ema = EMA(net, EMA_DECAY)
    params = [p for p in net.parameters() if p.requires_grad]
    tok = torch.randint(0, cfg.vocab_size, (accum, B, L), device=device, generator=g)
    shards = [{"tokens": tok[a]} for a in range(accum)]
    counter = iter(range(10 ** 9))
    done_steps: list[int] = []
    elf = get_method("elf")
    trained = TrainedPass(elf, net, sp, recipe)
    trained = torch.compile(trained) if compile else trained  # what the trainer compiles

    def fn(m=trained, o=opt, e=ema):
        s = next(counter)
        done_steps.append(s)
        train_step(m, shards, o, e, s, seed, 0, dtype, 1.0, 1, device, params)
    times = _timed(fn, device, warmup, iters)
    timed_steps = done_steps[warmup:]
    sc_rows = dec_rows = 0  # the pass mix of the timed steps' actual draws
    for s in timed_steps:
        for a in range(accum):
            gd, gc = shard_generators(seed, s, a, device)
            d = draw_training_noise((B, L, cfg.dim), recipe, generator=gd, cpu_generator=gc, device=device)
            sc_rows += int(d.self_cond.sum())
            dec_rows += int(d.decode.sum())
    n = len(timed_steps)
    net_f = train_step_flops(cfg, L, B * accum * n, sc_rows, dec_rows)
    muon_shapes = [tuple(p.shape) for name, p in net.named_parameters() if name in opt.muon_names]
    fb = {k: v / n for k, v in net_f.items()}
    fb["encoder"] = B * accum * encoder_flops(sp, L)
    fb["newton_schulz"] = newton_schulz_flops(muon_shapes, method=opt.ns_method)
    tokens = B * accum * L
    extra = dict(flops_breakdown=fb, accum=accum, tokens_per_optimizer_step=tokens, space=space,
                 grad_checkpoint=grad_checkpoint, adam_heads=adam_heads, ns_dtype=ns_dtype,
                 ns_method=opt.ns_method, ns_dtype_resolved=str(opt.ns_dtype).removeprefix("torch."),
                 selfcond_rows=sc_rows / n, decode_rows=dec_rows / n,
                 network_passes_per_token=(B * accum * n + sc_rows) / (B * accum * n),
                 reference_recipe=reference_recipe_flops(cfg, L))
    if breakdown:  # one more step with every phase synced and timed
        timer = _Timer(device)
        timed = TrainedPass(elf, _TimedNet(net, timer), sp, recipe)
        sp.encode = timer.wrap("encoder", sp.encode)
        opt.step = timer.wrap("optimizer", opt.step)
        ema.update = timer.wrap("ema", ema.update)
        t0 = time.perf_counter()
        fn(timed, opt, ema)
        _sync(device)
        total = time.perf_counter() - t0
        sec = dict(timer.seconds)
        sec["backward_and_rest"] = total - sum(sec.values())  # backward, loss arithmetic, grad clip
        sec["total"] = total
        extra["breakdown_seconds"] = sec
    return times, tokens, sum(fb.values()), extra
