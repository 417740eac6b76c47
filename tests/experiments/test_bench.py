"""`elflow bench`: the JSON it prints is self-consistent, and its FLOP formulas match an independent count."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from elflow.cli import main
from elflow.experiments.bench import encoder_flops, newton_schulz_flops, pass_flops, reference_recipe_flops
from elflow.model import ELF, get_config
from elflow.newton_schulz import newton_schulz

COMMON = ["--preset", "tiny", "--batch", "2", "--warmup", "1", "--iters", "1", "--peak-size", "256", "--json"]
KEYS = {"mode", "preset", "config", "device", "dtype", "compile", "batch", "length", "params", "flop_formula",
        "iterations", "seconds_per_iter", "seconds_per_iter_min", "tokens_per_iter", "tokens_per_s",
        "flops_per_iter", "flops_per_token", "flops_per_s", "peak_flops_per_s", "peak", "utilisation",
        "peak_memory_bytes", "memory_kind", "flops_breakdown"}


def run_bench(capsys, *args) -> dict:
    assert main(["bench", *args, *COMMON]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def check_consistent(r: dict) -> None:
    assert KEYS <= set(r)
    assert r["seconds_per_iter"] > 0 and r["peak_flops_per_s"] > 0 and r["peak_memory_bytes"] > 0
    assert math.isclose(r["tokens_per_s"], r["tokens_per_iter"] / r["seconds_per_iter"], rel_tol=1e-9)
    assert math.isclose(r["flops_per_s"], r["flops_per_iter"] / r["seconds_per_iter"], rel_tol=1e-9)
    assert math.isclose(r["flops_per_token"], r["flops_per_iter"] / r["tokens_per_iter"], rel_tol=1e-9)
    assert math.isclose(r["utilisation"], r["flops_per_s"] / r["peak_flops_per_s"], rel_tol=1e-9)
    assert math.isclose(sum(r["flops_breakdown"].values()), r["flops_per_iter"], rel_tol=1e-9)
    assert r["peak"]["flops_per_s"] == max(r["peak"]["matmul_flops_per_s"], r["peak"]["linear_flops_per_s"])
    assert r["peak"]["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[r["dtype"]]


def test_forward_json(capsys):
    r = run_bench(capsys, "forward", "--length", "16")
    check_consistent(r)
    assert r["mode"] == "forward" and r["length"] == 16 and r["tokens_per_iter"] == 2 * 16
    assert r["flops_per_iter"] == 2 * pass_flops(get_config("tiny"), 16, "x")


def test_sample_json(capsys):
    r = run_bench(capsys, "sample", "--steps", "3")
    check_consistent(r)
    c = get_config("tiny")
    assert r["sampling_steps"] == 3 and r["tokens_per_iter"] == 2 * c.max_length
    assert r["flops_per_iter"] == 2 * (3 * pass_flops(c, 32, "x") + pass_flops(c, 32, "logits"))


def test_train_json(capsys):
    r = run_bench(capsys, "train", "--accum", "2", "--space", "none", "--breakdown")
    check_consistent(r)
    assert r["tokens_per_optimizer_step"] == r["tokens_per_iter"] == 2 * 2 * 32
    fb = r["flops_breakdown"]
    assert set(fb) == {"selfcond_pass", "trained_pass", "encoder", "newton_schulz"} and fb["encoder"] == 0
    assert fb["trained_pass"] >= 3 * 4 * pass_flops(get_config("tiny"), 32, "x")
    assert 1.0 <= r["network_passes_per_token"] <= 2.0
    b = r["breakdown_seconds"]
    assert {"selfcond_pass", "trained_pass_forward", "optimizer", "ema", "backward_and_rest", "total"} <= set(b)
    assert math.isclose(sum(v for k, v in b.items() if k != "total"), b["total"], rel_tol=1e-6)


def test_bad_input_is_a_clean_error(capsys):
    assert main(["bench", "forward", "--preset", "tiny", "--batch", "0", "--json"]) == 2
    assert "--batch" in capsys.readouterr().err


BIG = str(10**12)
SIZES = [  # (mode, flag, value, what the one line says): every flag that sets memory or time, each kind of bad value
    *[("forward", f, "0", f"{f} must be >= 1, got 0") for f in ("--batch", "--length", "--iters", "--peak-size")],
    ("sample", "--steps", "0", "--steps must be an integer from 1 to 10,000"),
    ("train", "--accum", "0", "--accum must be >= 1, got 0"),
    *[("forward", f, "0", f"ELFConfig.{f[2:].replace('-', '_')} must be an integer from 1 to 1,099,511,627,776 (far "
                           "past any network), got 0") for f in ("--depth", "--hidden")],
    *[("forward", f, "-3", f"{f} must be >= 1, got -3") for f in ("--batch", "--length", "--iters", "--peak-size")],
    ("forward", "--warmup", "-1", "--warmup must be >= 0, got -1"),
    ("forward", "--threads", "-3", "--threads must be an integer from 1 to 4,096"),
    *[("forward", f, BIG, "needs about") for f in ("--batch", "--length", "--depth", "--hidden", "--vocab-size")],
    ("train", "--batch", BIG, "bench train at --batch 1000000000000 --accum 1 --length 32"),
    ("sample", "--batch", BIG, "bench sample at --steps 32 --batch 1000000000000 --length 32"),
    ("sample", "--steps", BIG, "--steps must be an integer from 1 to 10,000"),
    ("forward", "--iters", BIG, "--iters must be an integer from 1 to 100,000"),
    ("forward", "--warmup", BIG, "--warmup must be an integer from 0 to 100,000"),
    ("train", "--accum", BIG, "--accum must be an integer from 1 to 65,536"),
    ("forward", "--peak-size", BIG, "--peak-size must be an integer from 1 to 65,536"),
    ("forward", "--peak-size", "60000", "matmul peak"),  # within the bound, over this machine's memory
    ("forward", "--threads", BIG, "--threads must be an integer from 1 to 4,096"),
]


@pytest.mark.parametrize("mode,flag,value,needle", SIZES)
def test_a_bad_size_is_refused_in_one_line_before_any_work(capsys, monkeypatch, mode, flag, value, needle):
    """bench --steps 10^12, --batch 10^6, --peak-size 10^8 and the rest: one line, exit 2, before a network is
    built or a matmul timed."""
    from helpers import assert_one_error

    import elflow.experiments.bench as b
    from elflow.util import budget

    monkeypatch.setattr(budget, "available_memory", lambda device=None: (8 * 2**30, "available on this machine"))
    monkeypatch.setattr(b, "ELF", None)  # building a network would fail
    monkeypatch.setattr(b, "matmul_peak", None)
    code = main(["bench", mode, "--preset", "tiny", flag, value])
    assert_one_error(code, capsys.readouterr().err, "bench", needle)


@pytest.mark.parametrize("decode", [False, True])
def test_pass_flops_match_flop_counter(decode):
    """The formula against torch's FlopCounterMode (SDPA forced onto the math path so it is counted)."""
    c = get_config("tiny", depth=3, hidden=96, heads=6, dim=40, vocab_size=300)
    net = ELF(c).eval()
    B, L = 3, 20
    z = torch.randn(B, L, c.dim)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        net.decode(z, torch.full((B,), 2.0)) if decode else net(z, torch.rand(B), torch.full((B,), 2.0), z)
    assert fc.get_total_flops() == B * pass_flops(c, L, "logits" if decode else "x")


def test_newton_schulz_and_encoder_flops_match_flop_counter():
    for shape in [(48, 80), (96, 32)]:
        with FlopCounterMode(display=False) as fc:
            newton_schulz(torch.randn(*shape), dtype=torch.float32)
        assert fc.get_total_flops() == newton_schulz_flops([shape])
    pytest.importorskip("transformers")
    from elflow.experiments.bench import StandInSpace

    space = StandInSpace(64, 100, 24)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        space.encode(torch.randint(0, 100, (2, 24)))
    assert fc.get_total_flops() == 2 * encoder_flops(space, 24)


def test_recipe_costs_fewer_flops_than_the_reference_listing():
    r = reference_recipe_flops(get_config("elf-b"), 1024)
    assert r["elflow_per_token"] < r["reference_per_token"]
    # per denoising row: listing 1 + 0.5 + 3 passes, elflow 0.5 + 3; decode rows 3 in both
    assert 0.80 < r["ratio"] < 0.83
