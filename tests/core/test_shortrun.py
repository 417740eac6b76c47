"""The options for short runs: each against its closed form, the paper's network untouched when they are off,
and networks stored with the options among their config loading as they did."""

import json
import math

import pytest
import torch
from helpers import built_from, tiny_network

from elflow.methods.elf import METHOD
from elflow.model import ELF, ShortRunOptions, build_network, gaussian_posterior, get_config
from elflow.runs.migrate import SHORT_RUN_FIELDS
from elflow.util.errors import ELFError


def test_no_option_gives_the_papers_network_and_each_option_its_own_tensors():
    assert type(tiny_network()) is ELF and type(tiny_network(**ShortRunOptions().to_dict())) is ELF
    plain = tiny_network()
    for options, extra in [({"skip": "gaussian"}, {"skip_mean", "skip_var", "skip_noise"}),
                           ({"table_readout": 1.0}, {"readout_table"}),
                           ({"head_modulation": True}, {"head_modulation.weight", "head_modulation.bias"}),
                           ({"time_scale": 1000.0}, set()),
                           ({"skip": "gated"}, {"skip_mean", "skip_var", "skip_noise", "skip_gate.weight",
                                                "skip_gate.bias"})]:
        net = tiny_network(**options)
        assert type(net) is ELF and net.options.active and set(net.state_dict()) == set(plain.state_dict()) | extra
        if "head_modulation" not in options:  # no draws for the options: the paper network's weights as without
            assert all(torch.equal(v, net.state_dict()[k]) for k, v in plain.state_dict().items())
    with pytest.raises(ELFError, match="short-run options"):
        build_network(get_config("tiny"), {"skip": "residual"})


def test_a_network_stored_with_its_options_among_its_config_loads_with_the_same_outputs():
    """Stored networks may name the options (and activation checkpointing) in their config itself: they are
    read as the same network, with the same outputs."""
    net = tiny_network(skip="gaussian", time_scale=1000.0, head_modulation=True, table_readout=1.0)
    torch.nn.init.normal_(net.x_head.weight)
    torch.nn.init.normal_(net.head_modulation.weight, std=0.1)
    net.set_gaussian_skip(torch.randn(32) * 0.1, torch.rand(32) + 0.5, 2.0)
    net.set_readout_table(torch.randn(100, 32, generator=torch.Generator().manual_seed(2)))
    flat = {**net.config.to_dict(), **net.options.to_dict(), "grad_checkpoint": False}
    stored = json.loads(json.dumps(flat))  # version 1 of the record: the options among the network's settings
    options = ShortRunOptions.from_dict({k: stored.pop(k) for k in SHORT_RUN_FIELDS if k in stored})
    assert stored.pop("grad_checkpoint") is False  # the run's setting, which the step to version 2 drops (RUN_ONLY)
    cfg = METHOD.config_type.from_dict(stored)
    assert cfg == net.config and options == net.options
    assert METHOD.config_type.from_dict(net.config.to_dict()) == cfg
    again = built_from(net.state_dict(), cfg, options)
    z, t, w = torch.randn(2, 5, 32), torch.tensor([0.2, 0.9]), torch.ones(2)
    with torch.no_grad():
        assert torch.equal(again(z, t, w), net(z, t, w)) and torch.equal(again.decode(z, w), net.decode(z, w))
    with pytest.raises(ELFError, match="unexpected"):  # the options' tensors do not fit the paper's network
        built_from(net.state_dict(), cfg)


def test_gaussian_posterior_equals_a_regression_on_samples():
    """The closed form against a second estimate: per-dimension least squares of x on z over 400k draws of
    x ~ N(mean, var), z = t x + (1 - t) s e, and the variance of what it leaves."""
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
    net = tiny_network(skip="gaussian")
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
        tiny_network(time_scale=2.0).set_gaussian_skip(mean, var, 2.0)
    with pytest.raises(ValueError, match="skip must be one of"):
        ShortRunOptions(skip="residual")


def test_gated_skip_starts_as_the_gaussian_skip_and_a_closed_gate_passes_no_noise():
    """skip="gated": a fresh network equals the Gaussian skip's (the gate starts at 0); where the gate is 1 the
    guess is mean + std x head, whatever noise z holds."""
    gated, plain = tiny_network(skip="gated"), tiny_network(skip="gaussian")
    mean, var = torch.randn(32) * 0.1, torch.rand(32) + 0.5
    for net in (gated, plain):
        net.set_gaussian_skip(mean, var, 2.0)
    z, w, t = torch.randn(3, 5, 32), torch.ones(3), torch.tensor([0.2, 0.5, 0.9])
    with torch.no_grad():
        assert torch.equal(gated(z, t, w), plain(z, t, w))
        assert gated.num_params() == plain.num_params() + 64 * 32 + 32
        closed = torch.arange(32) < 16
        gated.skip_gate.bias.copy_(closed.float())
        torch.nn.init.normal_(gated.x_head.weight)
        out = gated(z, t, w)
        post_mean, std = gaussian_posterior(z, t, mean, var, 2.0)
        head = gated.x_head(gated.final_norm(gated.trunk(z, t, w, None, torch.zeros(3))))
        assert torch.allclose(out, torch.where(closed, mean, post_mean) + std * head, atol=1e-5)


def test_table_readout_adds_the_table_match_to_the_readout_only():
    net = tiny_network(table_readout=0.7)
    assert {n for n, p in net.named_parameters() if not p.requires_grad} == {"readout_table"}
    assert net.num_params() == tiny_network().num_params()  # the table is data, not trained
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
        tiny_network(time_scale=2.0).set_readout_table(table)
    with pytest.raises(ValueError, match="table_readout must be a number >= 0"):
        ShortRunOptions(table_readout=-1.0)


def test_time_scale_multiplies_t_before_its_features():
    net = tiny_network()
    torch.nn.init.normal_(net.x_head.weight)
    scaled = tiny_network(time_scale=1000.0)
    scaled.load_state_dict(net.state_dict())
    z, w, t = torch.randn(2, 5, 32), torch.ones(2), torch.tensor([0.001, 0.0004])
    assert torch.allclose(scaled(z, t, w), net(z, t * 1000, w), atol=1e-6)
    assert not torch.allclose(scaled(z, t, w), net(z, t, w), atol=1e-3)
    with pytest.raises(ValueError, match="time_scale"):
        ShortRunOptions(time_scale=0.0)


def test_head_modulation_starts_as_identity_and_can_switch_the_head_off():
    plain = tiny_network()
    torch.nn.init.normal_(plain.x_head.weight)
    mod = tiny_network(head_modulation=True)
    missing, unexpected = mod.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == ["head_modulation.bias", "head_modulation.weight"] and not unexpected
    z, t, w = torch.randn(2, 5, 32), torch.rand(2), torch.ones(2)
    assert torch.equal(mod(z, t, w), plain(z, t, w))  # zero-initialised: no modulation
    with torch.no_grad():  # scale = -1, shift = 0: the head sees zeros and returns its bias
        mod.head_modulation.bias[64:] = -1.0
        torch.nn.init.normal_(mod.x_head.bias)
    assert torch.allclose(mod(z, t, w), mod.x_head.bias.expand(2, 5, 32))
