"""The network: exact parameter counts of the released sizes, the call contract, precision, bad input."""

import json
import math
from pathlib import Path

import pytest
import torch

from elflow.model import ELF, PRESETS, ELFConfig, MixedPass, get_config

from helpers import reference_dir



@pytest.mark.parametrize("preset,key", [("elf-b", "ELF-B"), ("elf-m", "ELF-M"), ("elf-l", "ELF-L")])
def test_parameter_counts_equal_the_released_models(preset, key):
    ref = json.loads((reference_dir("param_counts.json") / "param_counts.json").read_text())[key]
    with torch.device("meta"):
        net = ELF(get_config(preset))
    assert net.num_params() == ref["total"]
    assert net.num_params(exclude_decode_head=True) == ref["total_excluding_decode_head"]
    assert sum(p.numel() for p in net.blocks[0].parameters()) == ref["per_block"]
    assert net.config.mlp_hidden == ref["swiglu_hidden_eff"]


def test_presets_match_the_spec_table():
    assert [(PRESETS[n].depth, PRESETS[n].hidden, PRESETS[n].heads) for n in ("elf-b", "elf-m", "elf-l")] == [
        (12, 768, 12), (24, 1056, 16), (32, 1280, 16)]
    for n in ("elf-b", "elf-m", "elf-l"):
        c = PRESETS[n]
        assert (c.bottleneck, c.time_tokens, c.omega_tokens, c.mode_tokens) == (128, 4, 4, 4)


def tiny(**kw):
    torch.manual_seed(0)
    return ELF(get_config("tiny", **kw))


def test_call_contract_shapes_and_free_length():
    net = tiny()
    for L in (1, 7, 32):
        z = torch.randn(3, L, 32)
        t, w = torch.rand(3), torch.full((3,), 3.0)
        assert net(z, t, w).shape == (3, L, 32)
        assert net(z, t, w, x_prev=torch.randn_like(z)).shape == (3, L, 32)
        assert net.decode(z, w).shape == (3, L, 100)


def test_x_prev_none_means_zeros_and_init_is_zero_head():
    net = tiny()
    z, t, w = torch.randn(2, 5, 32), torch.rand(2), torch.ones(2)
    assert torch.equal(net(z, t, w), torch.zeros(2, 5, 32))  # zero-initialised x head
    torch.nn.init.normal_(net.x_head.weight)
    assert torch.equal(net(z, t, w), net(z, t, w, x_prev=torch.zeros_like(z)))


def test_sequence_positions_are_independent_of_length_beyond_attention():
    """RoPE: a shift-invariant relative encoding; changing t changes the output; per-row gate equals
    the scalar gate row by row."""
    net = tiny()
    torch.nn.init.normal_(net.x_head.weight)
    z, t, w = torch.randn(4, 6, 32), torch.rand(4), torch.rand(4) * 4
    gate = torch.tensor([1.0, 0.0, 1.0, 0.0])
    rows = torch.tensor([0, 2])
    mixed, logits = net.mixed(z, t, w, None, gate, rows)
    on, _ = net.mixed(z, t, w, None, torch.ones(4), rows)
    off = net(z, t, w)
    assert torch.allclose(mixed[gate == 1], on[gate == 1], atol=1e-6)
    assert torch.allclose(mixed[gate == 0], off[gate == 0], atol=1e-6)
    # the logits of the chosen rows are the decode pass's when those rows are at t = 1
    t1 = t.clone()
    t1[rows] = 1.0
    _, logits = net.mixed(z, t1, w, None, gate, rows)
    assert torch.allclose(logits, net.decode(z[rows], w[rows]), atol=1e-5)
    assert not torch.allclose(net(z, t + 0.3, w), off)


def test_bf16_autocast_on_cpu_close_to_fp32():
    net = tiny()
    torch.nn.init.normal_(net.x_head.weight, std=0.1)
    z, t, w = torch.randn(2, 16, 32), torch.rand(2), torch.ones(2) * 2
    ref = net(z, t, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(z, t, w)
    assert out.dtype == torch.float32  # the heads run in fp32
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_gradient_checkpointing_gives_the_same_gradients():
    a, b = tiny(), tiny(grad_checkpoint=True)
    b.load_state_dict(a.state_dict())
    for net in (a, b):
        torch.nn.init.constant_(net.x_head.weight, 0.01)
        net.train()
    z, t, w = torch.randn(2, 8, 32), torch.rand(2), torch.ones(2)
    a(z, t, w).square().sum().backward()
    b(z, t, w).square().sum().backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        if n.startswith("decode_head"):  # unused in denoise mode
            assert p.grad is None and q.grad is None
            continue
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n


def test_torch_compile_works():
    net = tiny()
    compiled = torch.compile(net, backend="eager")
    z, t, w = torch.randn(2, 8, 32), torch.rand(2), torch.ones(2)
    assert torch.allclose(compiled(z, t, w), net(z, t, w))
    pair = torch.compile(MixedPass(net), backend="eager")
    gate, rows = torch.tensor([1.0, 0.0]), torch.tensor([0])
    for a, b in zip(pair(z, t, w, None, gate, rows), net.mixed(z, t, w, None, gate, rows)):
        assert torch.allclose(a, b)


@pytest.mark.parametrize("bad,match", [
    (dict(z=torch.randn(2, 5, 31)), r"z must have shape \(B, L, 32\)"),
    (dict(z=torch.randn(2, 33, 32)), "exceeds this network's max_length 32"),
    (dict(t=torch.rand(3)), r"t must be a tensor of shape \(2,\)"),
    (dict(omega=3.0), r"omega must be a tensor of shape \(2,\)"),
    (dict(x_prev=torch.randn(2, 4, 32)), "x_prev must have the shape of z"),
])
def test_mismatched_shapes_name_the_expected_ones(bad, match):
    net = tiny()
    args = dict(z=torch.randn(2, 5, 32), t=torch.rand(2), omega=torch.ones(2), x_prev=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        net(**args)


def test_config_validation_and_round_trip():
    with pytest.raises(ValueError, match="not divisible"):
        ELFConfig(hidden=100, heads=3)
    c = get_config("demo", dim=16)
    assert ELFConfig.from_dict(c.to_dict()) == c
    with pytest.raises(KeyError, match="unknown preset"):
        get_config("elf-xl")


def test_gaussian_posterior_equals_a_regression_on_samples():
    """The closed form against a second estimate: per-dimension least squares of x on z over 400k draws of
    x ~ N(mean, var), z = t x + (1 - t) s e, and the variance of what it leaves."""
    from elflow.model import gaussian_posterior

    g = torch.Generator().manual_seed(0)
    C, n, s = 6, 400_000, 2.0
    mean, var = torch.linspace(-1, 1, C), torch.linspace(0.2, 2.0, C)
    for t in (0.1, 0.4, 0.8):
        x = mean + var.sqrt() * torch.randn(n, C, generator=g)
        z = t * x + (1 - t) * s * torch.randn(n, C, generator=g)
        zc, xc = z - z.mean(0), x - x.mean(0)
        slope = (zc * xc).mean(0) / (zc * zc).mean(0)
        fit = x.mean(0) + slope * zc
        at0, post_std = gaussian_posterior(torch.zeros(1, 1, C), torch.full((1,), t), mean, var, s)
        at1, _ = gaussian_posterior(torch.ones(1, 1, C), torch.full((1,), t), mean, var, s)
        assert torch.allclose((at1 - at0).flatten(), slope, rtol=0.01, atol=0.004)  # the gain
        assert torch.allclose(at0.flatten(), x.mean(0) - slope * z.mean(0), atol=0.01)  # the intercept
        assert torch.allclose(post_std.flatten() ** 2, (x - fit).var(0), rtol=0.02)  # what is left


def test_gaussian_skip_starts_as_the_baseline_and_returns_clean_inputs_at_t1():
    from elflow.model import gaussian_posterior

    net = tiny(skip="gaussian")
    assert {n for n, p in net.named_parameters() if not p.requires_grad} == {"skip_mean", "skip_var", "skip_noise"}
    mean, var = torch.randn(32) * 0.1, torch.rand(32) + 0.5
    net.set_gaussian_skip(mean, var, 2.0)
    z, w = torch.randn(3, 5, 32), torch.ones(3)
    t = torch.tensor([0.0, 0.3, 1.0])
    out = net(z, t, w)
    assert torch.allclose(out, gaussian_posterior(z, t, mean, var, 2.0)[0])  # zero head: the posterior mean
    assert torch.allclose(out[0], mean.expand(5, 32)) and torch.allclose(out[2], z[2])  # t = 0: mean; t = 1: z
    torch.nn.init.normal_(net.x_head.weight)  # a trained head moves it, by at most the posterior std near t = 1
    moved = net(z, torch.tensor([0.3, 0.99, 1.0]), w) - gaussian_posterior(z, torch.tensor([0.3, 0.99, 1.0]),
                                                                              mean, var, 2.0)[0]
    assert moved[0].abs().max() > 0.1 and moved[2].abs().max() == 0
    with pytest.raises(ValueError, match="shape"):
        net.set_gaussian_skip(mean[:4], var, 2.0)
    with pytest.raises(ValueError, match="skip='none'"):
        tiny().set_gaussian_skip(mean, var, 2.0)
    with pytest.raises(ValueError, match="skip must be one of"):
        get_config("tiny", skip="residual")


def test_gated_skip_starts_as_the_gaussian_skip_and_a_closed_gate_passes_no_noise():
    """skip="gated": a fresh network equals the Gaussian skip's (the gate starts at 0); with the gate at 1 in
    a dimension the output there is mean + std * head, whatever z holds (no noise passed on)."""
    from elflow.model import gaussian_posterior

    gated, plain = tiny(skip="gated"), tiny(skip="gaussian")
    mean, var = torch.randn(32) * 0.1, torch.rand(32) + 0.5
    for net in (gated, plain):
        net.set_gaussian_skip(mean, var, 2.0)
    z, w, t = torch.randn(3, 5, 32), torch.ones(3), torch.tensor([0.2, 0.5, 0.9])
    assert torch.allclose(gated(z, t, w), plain(z, t, w))
    assert gated.num_params() == plain.num_params() + 64 * 32 + 32
    closed = torch.arange(32) < 16
    with torch.no_grad():
        gated.skip_gate.bias.copy_(closed.float())
        torch.nn.init.normal_(gated.x_head.weight)
    a = gated(z, t, w)
    post_mean, std = gaussian_posterior(z, t, mean, var, 2.0)
    h = gated.trunk(z, t, w, None, torch.zeros(3))
    head = gated.x_head(gated.final_norm(h))
    expect = torch.where(closed, mean, post_mean) + std * head
    assert torch.allclose(a, expect, atol=1e-5)


def test_table_readout_adds_the_table_match_to_the_readout_only():
    net = tiny(table_readout=0.7)
    assert {n for n, p in net.named_parameters() if not p.requires_grad} == {"readout_table"}
    assert net.num_params() == tiny().num_params()  # the table is data, not trained
    table = torch.randn(100, 32, generator=torch.Generator().manual_seed(0))
    net.set_readout_table(table)
    ids = torch.randint(0, 100, (3, 7), generator=torch.Generator().manual_seed(1))
    w = torch.ones(3)
    with torch.no_grad():
        z = torch.randn(3, 7, 32)
        h = net.trunk(z, torch.ones(3), w, None, torch.ones(3))
        head = net.decode_head(h)
        expect = head.clone()  # logits = head(h) + 0.7 z . R_k / sqrt(C), written out per position and token
        for b in range(3):
            for i in range(7):
                for k in range(100):
                    expect[b, i, k] += 0.7 * float(z[b, i] @ table[k]) / math.sqrt(32)
        assert torch.allclose(net.decode(z, w), expect, atol=1e-4)
        rows = torch.tensor([2, 0])  # the training pass keeps the head's own logits
        _, logits = net.mixed(z, torch.ones(3), w, None, torch.ones(3), rows)
        assert torch.allclose(logits, head[rows], atol=1e-5)
        # the head silenced: the table match alone reads each clean row as its own token
        net.decode_head.unembed.weight.zero_()
        net.decode_head.unembed.bias.zero_()
        assert torch.equal(net.decode(table[ids], w).argmax(-1), ids)
    with pytest.raises(ValueError, match="shape"):
        net.set_readout_table(table[:10])
    with pytest.raises(ValueError, match="without table_readout"):
        tiny().set_readout_table(table)
    with pytest.raises(ValueError, match="table_readout must be a number >= 0"):
        get_config("tiny", table_readout=-1.0)


def test_time_scale_multiplies_t_before_its_features():
    net = tiny()
    torch.nn.init.normal_(net.x_head.weight)
    scaled = ELF(get_config("tiny", time_scale=1000.0))
    scaled.load_state_dict(net.state_dict())
    z, w, t = torch.randn(2, 5, 32), torch.ones(2), torch.tensor([0.001, 0.0004])
    assert torch.allclose(scaled(z, t, w), net(z, t * 1000, w), atol=1e-6)
    assert not torch.allclose(scaled(z, t, w), net(z, t, w), atol=1e-3)
    with pytest.raises(ValueError, match="time_scale"):
        get_config("tiny", time_scale=0.0)


def test_head_modulation_starts_as_identity_and_can_switch_the_head_off():
    plain = tiny()
    torch.nn.init.normal_(plain.x_head.weight)
    mod = ELF(get_config("tiny", head_modulation=True))
    missing, unexpected = mod.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == ["head_modulation.bias", "head_modulation.weight"] and not unexpected
    z, t, w = torch.randn(2, 5, 32), torch.rand(2), torch.ones(2)
    assert torch.equal(mod(z, t, w), plain(z, t, w))  # zero-initialised: no modulation
    with torch.no_grad():  # scale = -1, shift = 0: the head sees zeros and returns its bias
        mod.head_modulation.bias[64:] = -1.0
        torch.nn.init.normal_(mod.x_head.bias)
    assert torch.allclose(mod(z, t, w), mod.x_head.bias.expand(2, 5, 32))
