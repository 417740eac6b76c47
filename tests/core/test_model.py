"""The network: exact parameter counts of the released sizes, the call contract, precision, bad input."""

import json

import pytest
import torch
from helpers import reference_dir, tiny_network

from elflow.model import ELF, PRESETS, ELFConfig, get_config


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


def test_call_contract_shapes_and_free_length():
    net = tiny_network()
    for L in (1, 7, 32):
        z = torch.randn(3, L, 32)
        t, w = torch.rand(3), torch.full((3,), 3.0)
        assert net(z, t, w).shape == (3, L, 32)
        assert net(z, t, w, x_prev=torch.randn_like(z)).shape == (3, L, 32)
        assert net.decode(z, w).shape == (3, L, 100)


def test_x_prev_none_means_zeros_and_init_is_zero_head():
    net = tiny_network()
    z, t, w = torch.randn(2, 5, 32), torch.rand(2), torch.ones(2)
    assert torch.equal(net(z, t, w), torch.zeros(2, 5, 32))  # zero-initialised x head
    torch.nn.init.normal_(net.x_head.weight)
    assert torch.equal(net(z, t, w), net(z, t, w, x_prev=torch.zeros_like(z)))


def test_sequence_positions_are_independent_of_length_beyond_attention():
    """RoPE: a shift-invariant relative encoding; changing t changes the output; per-row gate equals
    the scalar gate row by row."""
    net = tiny_network()
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
    net = tiny_network()
    torch.nn.init.normal_(net.x_head.weight, std=0.1)
    z, t, w = torch.randn(2, 16, 32), torch.rand(2), torch.ones(2) * 2
    ref = net(z, t, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(z, t, w)
    assert out.dtype == torch.float32  # the heads run in fp32
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_gradient_checkpointing_gives_the_same_gradients():
    a, b = tiny_network(), tiny_network()
    b.grad_checkpoint = True
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
    net = tiny_network()
    compiled = torch.compile(net, backend="eager")
    z, t, w = torch.randn(2, 8, 32), torch.rand(2), torch.ones(2)
    assert torch.allclose(compiled(z, t, w), net(z, t, w))
    pair = torch.compile(net.mixed, backend="eager")
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
    net = tiny_network()
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
