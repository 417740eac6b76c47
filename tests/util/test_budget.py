"""The size check (elflow.util.budget): counts held under their bounds with one-line errors, estimates refused
against the memory available, that memory read within the process's limits, and estimates that bound the
measured peak memory of real calls (in a fresh process) from above, within about a factor of two."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elflow.util import budget
from elflow.util.budget import (
    MAX_SAMPLES,
    MAX_SAMPLING_STEPS,
    Estimate,
    check_count,
    check_elf_sampling,
    check_fits,
    check_toy,
    elf_sampling,
)
from elflow.util.errors import ELFError

SRC = Path(__file__).resolve().parents[2] / "src"
GiB = 2**30


class Config:
    """What an ELF sampling estimate reads of a network's ELFConfig: the tiny preset's shape."""
    depth, hidden, heads, dim, vocab_size, max_length, num_prefix, mlp_hidden = 2, 64, 4, 32, 100, 16, 12, 170


def with_memory(monkeypatch, nbytes):
    monkeypatch.setattr(budget, "available_memory", lambda device=None: (nbytes, "available on this machine"))


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and text
    return text


# ----------------------------------------------------------------------------------------------------------
# counts
@pytest.mark.parametrize("value,shown", [(0, "got 0"), (-3, "got -3"), (float("nan"), "got nan"),
                                         (float("inf"), "got inf"), (10**12, "got 1,000,000,000,000"),
                                         (2.5, "got 2.5"), (True, "got True"), ("12", "got '12'"), (None, "got None")])
def test_a_count_out_of_range_or_not_an_integer_is_one_line_naming_the_flag_the_range_and_why(value, shown):
    with pytest.raises(ELFError) as e:
        check_count(value, "--steps", 10_000, "the released recipe samples with at most 64 steps",
                    hint="pass a smaller --steps")
    line = one_line(e)
    assert line.startswith("--steps must be an integer from 1 to 10,000 (the released recipe samples with at most "
                           "64 steps), ") and shown in line and line.endswith("; pass a smaller --steps")


def test_a_count_in_range_comes_back_as_an_int_also_from_a_whole_float():
    assert check_count(64, "--steps", 10_000, "") == 64
    assert check_count(64.0, "steps in m/sampling.json", 10_000, "") == 64
    assert type(check_count(64.0, "x", 10_000, "")) is int
    assert check_count(0, "--warmup", 10, "", low=0) == 0
    assert check_count(10_000, "--steps", 10_000, "") == 10_000


# ----------------------------------------------------------------------------------------------------------
# the memory of the device
def test_an_estimate_over_the_available_memory_is_refused_in_one_line_with_its_parts(monkeypatch):
    with_memory(monkeypatch, GiB)
    est = Estimate("sampling", "--batch 8 --length 64", {"activations": 3 * GiB, "logits": GiB // 2}, "choose less")
    with pytest.raises(ELFError) as e:
        check_fits(est)
    assert one_line(e) == ("sampling at --batch 8 --length 64 needs about 3.5 GiB (activations 3.0 GiB, logits "
                           "512.0 MiB), more than the 1.0 GiB of memory available on this machine; choose less")
    small = Estimate("sampling", "--batch 1", {"activations": GiB - 1})
    assert check_fits(small) is small


def test_sizes_past_any_unit_are_written_in_powers_of_ten():
    assert budget.size(3 * 2**60) == "3.1e+03 PiB" and budget.size(1536) == "1.5 KiB"


def test_the_available_memory_of_a_cpu_is_within_the_machine_and_within_an_address_space_limit():
    have, where = budget.available_memory("cpu")
    assert 0 < have <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and where
    code = ("import resource; from elflow.util.budget import available_memory, _cpu_available\n"
            "size = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024\n"
            "resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, resource.RLIM_INFINITY))\n"
            "print(*available_memory('cpu'), sep='|')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.returncode == 0, out.stderr
    have, where = out.stdout.strip().split("|")
    assert 0.9 * 2**30 < int(have) <= 2**30 and "limit" in where


def test_buffers_of_several_sizes_are_each_counted_by_their_own_size():
    """A float64 copy of an fp32 buffer can be past HEAP_BLOCK where the fp32 one is not: each is held by its
    own size, not all by the smallest's (MDLM's draws were counted twice over that way)."""
    small, big = budget.HEAP_BLOCK // 2, budget.HEAP_BLOCK * 2
    assert budget.buffers(small, big, big) == budget.ALLOCATOR_SLACK * small + 2 * big
    assert budget.buffers(small, small) == budget.held(small, 2 * small)
    assert budget.buffers() == 0


def test_a_cpu_readout_counts_one_copy_of_its_weight_for_the_blas_and_a_gpu_none():
    cpu = budget.transformer_pass(4, 16, 64, 2, 4, vocab=1000)
    assert cpu["BLAS workspace"] == budget.tensor(64, 1000)
    assert budget.transformer_pass(4, 16, 64, 2, 4, vocab=1000, gpu=True)["BLAS workspace"] == 0
    assert budget.transformer_pass(4, 16, 64, 2, 4)["BLAS workspace"] == 0
    assert elf_sampling(Config, steps=2, batch_size=2, num=2).parts["BLAS workspace"] == budget.tensor(
        Config.dim, Config.vocab_size)


def _tree(tmp_path, files: dict) -> str:
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return str(tmp_path)


MEMINFO = "MemTotal: 67108864 kB\nMemAvailable: 20971520 kB\n"  # 20 GiB available on the machine
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_a_cgroup_v2_limit_on_the_process_s_own_cgroup_is_seen_with_its_page_cache_free(tmp_path):
    """A job's own cgroup (a Slurm step, a Kubernetes pod: /proc/self/cgroup), not the hierarchy's root, holds
    the limit; its inactive file cache is reclaimable: a 6 GiB limit using 5.5 GiB of which 3 GiB is cache
    leaves 3.5 GiB, as the kernel would give."""
    root = _tree(tmp_path, {
        "proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/job/step\n", "proc/self/mountinfo": V2_MOUNT,
        "sys/fs/cgroup/memory.max": "max\n",
        "sys/fs/cgroup/job/memory.max": "max\n", "sys/fs/cgroup/job/memory.current": str(6 * GiB),
        "sys/fs/cgroup/job/step/memory.max": str(6 * GiB), "sys/fs/cgroup/job/step/memory.current": str(
            int(5.5 * GiB)), "sys/fs/cgroup/job/step/memory.stat": f"anon 100\ninactive_file {3 * GiB}\n"})
    assert budget._cpu_available(root) == (int(3.5 * GiB), "left under this process's memory limit (cgroup)")
    # a parent's tighter limit binds too
    (tmp_path / "sys/fs/cgroup/job/memory.max").write_text(str(6 * GiB + GiB // 4))
    assert budget._cpu_available(root)[0] == GiB // 4
    # no limit anywhere: the machine's MemAvailable
    for f in ("job/memory.max", "job/step/memory.max"):
        (tmp_path / "sys/fs/cgroup" / f).write_text("max\n")
    assert budget._cpu_available(root) == (20 * GiB, "available on this machine")


def test_a_cgroup_v1_memory_limit_is_read_where_the_memory_hierarchy_is_mounted(tmp_path):
    """cgroup v1 (Docker without a cgroup namespace, older Slurm): the memory controller's line of
    /proc/self/cgroup, placed by the mount's own root; total_inactive_file counted as free."""
    mount = ("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
             "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
             "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    root = _tree(tmp_path, {
        "proc/meminfo": MEMINFO, "proc/self/mountinfo": mount,
        "proc/self/cgroup": "1:cpu:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": str(2 * GiB),
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(int(1.9 * GiB)),
        "sys/fs/cgroup/memory/memory.stat": f"cache {GiB}\ntotal_inactive_file {GiB}\n"})
    have, where = budget._cpu_available(root)
    assert have == 2 * GiB - (int(1.9 * GiB) - GiB) and "cgroup" in where
    # the limit v1 writes for none (a page-rounded 2^63) is no limit
    (tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712")
    assert budget._cpu_available(root) == (20 * GiB, "available on this machine")


def test_unreadable_machine_files_fall_back_to_the_machine_s_memory(tmp_path):
    have, where = budget._cpu_available(_tree(tmp_path, {"proc/self/cgroup": "garbage\n"}))
    assert have == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and where == "on this machine"


def test_block_params_counts_a_block():
    import torch

    from elflow.model import Block, num_params

    for width, heads, mlp in ((64, 4, 170), (96, 2, 256)):
        with torch.device("meta"):
            assert budget.block_params(width, heads, mlp) == num_params(Block(width, heads, mlp))


@pytest.mark.parametrize("preset,kw", [("tiny", {}), ("demo", {}), ("elf-b", {}), ("tiny", {"conditioning": "adaln"}),
                                       ("tiny", {"self_cond": False}), ("demo", {"decoder": "separate"})])
def test_elf_params_counts_every_parameter_and_buffer_of_the_network(preset, kw):
    import torch

    from elflow.model import build_network, get_config

    cfg = get_config(preset, **kw)
    with torch.device("meta"):
        net = build_network(cfg)
    assert budget.elf_params(cfg) == sum(t.numel() for t in [*net.parameters(), *net.buffers()])
    assert budget.elf_params(cfg.replace(hidden=10**12, heads=4)) > 10**24  # any size, at once


# ----------------------------------------------------------------------------------------------------------
# an ELF sampling call
def test_a_sampling_step_count_past_the_bound_is_refused_before_any_estimate(monkeypatch):
    """sample --steps 10^12 (and a model folder's stored steps): refused by its bound, named where it comes from."""
    with_memory(monkeypatch, 10**18)
    for steps in (10**12, MAX_SAMPLING_STEPS + 1, 0, -2):
        with pytest.raises(ELFError, match=r"^--steps must be an integer from 1 to 10,000 "):
            check_elf_sampling(Config, steps=steps, batch_size=2, num=2)
    with pytest.raises(ELFError, match=r"^steps in m/sampling.json must be an integer from 1 to 10,000"):
        check_elf_sampling(Config, steps=10**12, batch_size=2, num=2, flags={"steps": "steps in m/sampling.json"})
    with pytest.raises(ELFError, match=r"^--num must be an integer from 1 to 10,000,000 "):
        check_elf_sampling(Config, steps=2, batch_size=1, num=10**9)
    with pytest.raises(ELFError, match=r"^--teacher-steps must be an integer from 1 to 10,000 "):
        budget.check_sampling_steps(10**12, "--teacher-steps")
    with pytest.raises(ELFError, match=r"^--trajectory must be an integer from 0 to 4 "):
        check_elf_sampling(Config, steps=4, batch_size=1, num=1, trajectory_steps=5)
    assert check_elf_sampling(Config, steps=MAX_SAMPLING_STEPS, batch_size=2, num=MAX_SAMPLES).total > 0


def test_a_batch_whose_activations_exceed_the_memory_is_refused_naming_its_flags(monkeypatch):
    """sample --num 200000 --batch 200000 on the tiny network: 1.4 GB of attention scores alone passed the old
    attention check; the whole pass needs tens of GiB."""
    with_memory(monkeypatch, 3 * GiB)
    with pytest.raises(ELFError) as e:
        check_elf_sampling(Config, steps=1, batch_size=200_000, num=200_000, length=16)
    line = one_line(e)
    assert line.startswith("sampling at --steps 1 --batch 200000 --num 200000 --length 16 needs about ")
    assert "activations" in line and "more than the 3.0 GiB of memory available" in line and "--batch" in line
    check_elf_sampling(Config, steps=1, batch_size=64, num=200_000, length=16)  # the same samples in small batches


def test_the_sampling_estimate_grows_with_what_it_holds():
    def total(**kw):
        return elf_sampling(Config, **{"steps": 8, "batch_size": 8, "num": 8, **kw}).total

    assert total(batch_size=64, num=64) > 4 * total()
    assert total(num=10_000) - total() >= 10_000 * budget.RECORD_BYTES * 0.99  # records of the samples
    assert total(trajectory_steps=8) - total() == 8 * 8 * 16 * (budget.TRAJECTORY_BYTES_PER_TOKEN + 8)
    assert total(guided=True) > total() and total(table_readout=True) > total()
    assert total(params=10**6) - total() == 4 * 10**6
    est = elf_sampling(Config, steps=2, batch_size=4, num=4, flags={"num": None, "batch_size": "--batch-size"})
    assert est.flags == "--steps 2 --batch-size 4 --length 16"


# ----------------------------------------------------------------------------------------------------------
# products of counts
def test_the_products_of_counts_are_bounded_each_with_its_reason():
    """Each count within its own bound, their product is held under one too: a sweep's cells x --num, eval's
    --seeds x --num, a run's previews (steps / --sample-every x --sample-steps x 2 samples); one line naming
    every factor, the product, the bound and why it is there."""
    grid = {"sampler": ["ode", "sde"], "steps": list(range(1, 2001)), "omega": [1.0] * 2000}
    with pytest.raises(ELFError) as e:
        budget.check_sweep(grid, 10_000)
    assert one_line(e).startswith("2 --sampler values x 2,000 --steps values x 2,000 --omega values x --num 10,000 "
                                  "make 80,000,000,000 samples, more than 10,000,000 (the paper's sweeps score 5,000 "
                                  "samples in each of a few dozen cells")
    assert budget.check_sweep({"omega": [0.5, 1, 2, 3, 4], "steps": [8, 16, 32], "sampler": ["ode", "sde"]},
                              5_000) == 150_000
    with pytest.raises(ELFError) as e:
        budget.check_seeds(30_000, 10_000_000)
    assert one_line(e).startswith("30,000 --seeds x --num 10,000,000 make 300,000,000,000 samples, more than "
                                  "10,000,000 (the paper scores 5,000 samples per setting and seed")
    assert budget.check_seeds(3, 5_000) == 15_000
    with pytest.raises(ELFError) as e:
        budget.check_previews(10_000, 1, 10_000)
    assert one_line(e).startswith("10,000 previews (--steps 10,000 / --sample-every 1) x --sample-steps 10,000 x "
                                  "2 samples make 200,000,000 network passes of one row, more than 2,000,000")
    assert budget.check_previews(95_000, 1_000, 64) == 12_160  # ELF-B's run, previewed every 1,000 steps
    assert budget.check_previews(250, 62, 64) == 512  # the quickstart's
    assert budget.check_previews(10**12, 0, 10_000) == 0  # no previews


def test_the_one_memory_check_is_the_budget_s():
    """Every size is checked by check_fits against what this process can still take (its cgroup and ulimit
    within the machine's memory); the second check, against the machine's whole memory, is gone."""
    from elflow.util import devices

    assert not hasattr(devices, "check_memory") and not hasattr(devices, "device_memory")


# ----------------------------------------------------------------------------------------------------------
# a training step
class Shape:
    """What a training estimate reads of an ELFConfig: ELF-L's shape in MiniLM's space."""
    depth, hidden, heads, dim, vocab_size, max_length, num_prefix, mlp_hidden, bottleneck = (
        32, 1280, 16, 384, 30522, 16, 12, 3413, 128)
    time_tokens, omega_tokens, mode_tokens = 4, 4, 4


def test_a_training_step_counts_the_network_s_state_and_the_passes_at_the_micro_batch(monkeypatch):
    """train --preset elf-l --space minilm --batch 4 --length 16 under a 6 GB limit: the weights, gradients,
    optimiser state and EMA alone take 12 GiB, said in one line with what to do; the passes grow with the rows,
    and less with activation checkpointing, more with a flow map's tangents and a teacher."""
    def total(**kw):
        return budget.elf_training(Shape, **{"rows": 4, "length": 16, **kw}).total

    with_memory(monkeypatch, 6 * GiB)
    with pytest.raises(ELFError) as e:
        check_fits(budget.elf_training(Shape, rows=4, length=16, flags="--preset elf-l --batch 4 --length 16"))
    line = one_line(e)
    assert line.startswith("training at --preset elf-l --batch 4 --length 16 needs about 13.3 GiB (optimiser state")
    assert "EMA" in line and "more than the 6.0 GiB of memory" in line
    assert line.endswith("optimiser state and EMA alone take 12.2 GiB: choose a smaller --preset (or --depth / "
                         "--hidden)")
    assert total(rows=64) > total() + 8 * GiB
    assert total(rows=64, checkpointing=True) < total(rows=64) - 4 * GiB
    assert total(tangents=True) > total() and total(teacher=Shape) > total() and total(previews=True) > total()
    assert total(teacher=Shape, teacher_weights=GiB) == total(teacher=Shape) + GiB
    assert total(gpu=True, bf16=True) < total()
    with_memory(monkeypatch, 10 * GiB)
    tiny = type("Tiny", (Shape,), {"depth": 2, "hidden": 64, "heads": 4, "dim": 32, "vocab_size": 100,
                                   "mlp_hidden": 170})
    with pytest.raises(ELFError, match="choose a smaller --micro-batch"):
        check_fits(budget.elf_training(tiny, rows=4096, length=1024))


# ----------------------------------------------------------------------------------------------------------
# the toy
def test_the_toy_s_memory_is_checked(monkeypatch):
    """The toy's counts are its command's (elflow.cli.toy); what they hold is checked against the memory."""
    with_memory(monkeypatch, GiB)
    assert check_toy(44, [1, 2, 4, 8, 16], 8).total < 100 * 2**20
    with pytest.raises(ELFError) as e:
        check_toy(100_000, [1, 2], 10_000)
    assert "needs about" in one_line(e) and "--clusters 10000" in one_line(e)


# ----------------------------------------------------------------------------------------------------------
# estimates against measured peaks
MEASURE = r"""
import ctypes, gc, json, sys
import torch

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def peak(fn):
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    base = status("VmRSS:")
    fn()
    return status("VmHWM:") - base

CASE
small()  # kernels' first use, not the call's
measured = max(peak(call), peak(call))
estimate = estimate() if callable(estimate) else estimate  # (a sampler's, made by its own check)
print(json.dumps({"measured": measured, "estimate": estimate.total, "parts": estimate.parts}))
"""

CASES = {
    "elf-sampling": """
from elflow.sampler import generate_tokens
from elflow.model import ELF, get_config
from elflow.util.budget import elf_sampling
cfg = get_config("tiny", hidden=128, heads=4)
net = ELF(cfg).eval()
small = lambda: torch.no_grad()(generate_tokens)(net, 2, 32, steps=2)
call = lambda: torch.no_grad()(generate_tokens)(net, 256, 32, steps=2)
estimate = elf_sampling(cfg, steps=2, batch_size=256, num=256, length=32)
""",
    "elf-sampling-readout": """
from elflow.sampler import generate_tokens
from elflow.model import ELF, get_config
from elflow.util.budget import elf_sampling
cfg = get_config("demo", depth=2, hidden=128, heads=2)
net = ELF(cfg).eval()
small = lambda: torch.no_grad()(generate_tokens)(net, 1, 64, steps=1)
call = lambda: torch.no_grad()(generate_tokens)(net, 16, 64, steps=2)
estimate = elf_sampling(cfg, steps=2, batch_size=16, num=16, length=64)
""",
    "judge-training": """
import torch.nn.functional as F
from elflow.eval.judge import CausalJudge, JudgeConfig, check_judge_training
cfg = JudgeConfig(hidden=64, depth=2, heads=2, context=64)
def train(batch, steps=2):
    judge = CausalJudge(cfg)
    opt = torch.optim.AdamW(judge.parameters())
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1))
    for _ in range(steps):
        loss = F.cross_entropy(judge(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
small = lambda: train(1, 1)
call = lambda: train(8)
estimate = check_judge_training(cfg, 8, 2, "cpu")
""",
    "encoder-training": """
from transformers import T5Config, T5ForConditionalGeneration
from elflow.experiments.encoder_train import check_encoder_training, window_lengths
H, depth, heads, L, B, vocab = 64, 2, 4, 64, 16, 200
V = 64 * -(-(vocab + 100) // 64)
cfg = T5Config(vocab_size=V, d_model=H, d_kv=H // heads, d_ff=4 * H, num_layers=depth, num_decoder_layers=depth,
               num_heads=heads, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
               feed_forward_proj="gated-gelu")
n_in, n_out = window_lengths(L, 0.15, 3.0)
def train(batch, steps=2):
    model = T5ForConditionalGeneration(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    x, y = torch.randint(3, V, (batch, n_in)), torch.randint(3, V, (batch, n_out))
    for _ in range(steps):
        loss = model(input_ids=x, attention_mask=torch.ones_like(x), labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
small = lambda: train(1, 1)
call = lambda: train(B)
estimate = check_encoder_training(vocab=vocab, length=L, density=0.15, span=3.0, hidden=H, depth=depth, heads=heads,
                                  batch=B, steps=2, device="cpu")
""",
    "elf-training": """
from torch import nn
from elflow.flow import Recipe
from elflow.methods import get_method
from elflow.methods.base import TrainedPass
from elflow.model import build_network, get_config
from elflow.optim import EMA, ELFOptimizer
from elflow.train import train_step
from elflow.util.budget import elf_training
V, C, L = 1000, 32, 64
class Space(nn.Module):
    trainable = False
    def __init__(self):
        super().__init__()
        self.table, self.dim = nn.Embedding(V, C).requires_grad_(False), C
    def encode(self, ids, attention=None):
        return self.table(ids)
cfg = get_config("tiny", dim=C, vocab_size=V, max_length=L)
def train(batch, steps=2):
    net = build_network(cfg)
    opt, ema = ELFOptimizer(list(net.named_parameters()), lr=1e-3), EMA(net, 0.999)
    model = TrainedPass(get_method("elf"), net, Space(), Recipe())
    for s in range(steps):
        train_step(model, [{"tokens": torch.randint(0, V, (batch, L))}], opt, ema, s, 0, 0, "fp32")
small = lambda: train(1, 1)
call = lambda: train(64)
estimate = elf_training(cfg, rows=64, length=L)
""",
    "mdlm-sampling": """
import types
from elflow.methods import mdlm
from elflow.methods.token_net import TokenLMConfig
from elflow.util import budget
seen = []
mdlm.check_fits = lambda estimate, device=None: seen.append(estimate) or estimate
net = mdlm.build(TokenLMConfig(depth=2, hidden=128, heads=4, vocab_size=3000, max_length=64),
                 types.SimpleNamespace(vocab_size=3000)).eval()
settings = mdlm.MDLMSampling(steps=1)
small = lambda: mdlm.generate_tokens(net, 1, 64, settings, torch.Generator().manual_seed(0))
call = lambda: mdlm.generate_tokens(net, 32, 64, settings, torch.Generator().manual_seed(0))
estimate = lambda: seen[-1]
""",
    "ar-sampling": """
import types
from elflow.methods import ar
from elflow.methods.token_net import TokenLMConfig
seen = []
ar.check_fits = lambda estimate, device=None: seen.append(estimate) or estimate
net = ar.build(TokenLMConfig(depth=2, hidden=256, heads=4, vocab_size=1000, max_length=32),
               types.SimpleNamespace(vocab_size=1000)).eval()
small = lambda: ar.generate_tokens(net, 1, 8, ar.ARSampling(), torch.Generator().manual_seed(0))
call = lambda: ar.generate_tokens(net, 128, 32, ar.ARSampling(), torch.Generator().manual_seed(0))
estimate = lambda: seen[-1]
""",
    "schedules": """
from elflow.experiments.schedules import check_schedules, schedule_statistics
small = lambda: schedule_statistics(n=100)
call = lambda: schedule_statistics(n=400_000)
estimate = check_schedules(400_000)
estimate.parts.pop("figure")  # (no figure is drawn here)
""",
    "toy": """
from elflow.experiments.toy import plot_toy, ring_mixture, run_toy
from elflow.util.budget import check_toy
import tempfile, os
mix = ring_mixture(8)
folder = tempfile.mkdtemp()
def draw(num):
    plot_toy(mix, run_toy(mix, [1, 2, 4, 8, 16], num), os.path.join(folder, "t.png"))
small = lambda: run_toy(mix, [1], 2)  # (no figure yet: the call's peak holds the figure's canvas)
call = lambda: draw(500)
estimate = check_toy(500, [1, 2, 4, 8, 16], 8)
""",
}


SLOW = ("elf-sampling", "judge-training", "encoder-training", "ar-sampling", "toy", "elf-training")  # 10-70 s each on a busy CPU


def _marks(case: str) -> tuple:
    return (pytest.mark.slow,) if case in SLOW else ()


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the peak RSS is read from Linux's /proc")
@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c)) for c in CASES])
def test_the_estimate_bounds_the_measured_peak_within_about_two(case):
    """In a fresh process, the peak RSS of the call (above what the process held before it, the larger of two
    calls) never exceeds its estimate, and the estimate is at most about twice that peak."""
    out = subprocess.run([sys.executable, "-c", MEASURE.replace("CASE", CASES[case])], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    measured, estimate = got["measured"], got["estimate"]
    assert measured <= estimate <= 2.25 * measured, (measured, estimate, got["parts"])
