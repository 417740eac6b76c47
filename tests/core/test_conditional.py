"""Conditional generation against the authors' own layout, sampling loops and target extraction
(their reference vectors, run on the tiny reference weights: tests/reference)."""

import json

import pytest
import torch
from helpers import built_from, reference_dir
from safetensors.torch import load_file

from elflow.data.layout import encoder_mask, pair_layout
from elflow.generate import extract_targets
from elflow.runs.released import released_to_elflow
from elflow.sampler import decode_tokens, integrate

REF = reference_dir("authors_cond_distill.safetensors", "authors_cond_distill.json", "official_tiny.safetensors")
EOS = 1


@pytest.fixture(scope="module")
def ref():
    return load_file(REF / "authors_cond_distill.safetensors")


@pytest.fixture(scope="module")
def cases():
    return json.loads((REF / "authors_cond_distill.json").read_text())["cases"]


@pytest.fixture(scope="module")
def net():
    w = load_file(REF / "official_tiny.safetensors")
    sd = released_to_elflow({k[len("params."):]: v for k, v in w.items() if k.startswith("params.")})
    return built_from(sd).eval()


def test_pair_layout_equals_the_authors_collator(ref, cases):
    c = cases["layout"]
    lay = pair_layout(c["sources"], c["targets"], c["max_length"], c["max_input_length"], c["pad_id"])
    assert torch.equal(lay["ids"], ref["layout.ids"])
    assert torch.equal(lay["source_mask"], ref["layout.cond_seq_mask"].bool())
    assert torch.equal(lay["valid"], ref["layout.attention_mask"].bool())
    assert torch.equal(lay["encoder_mask"], ref["layout.encoder_attention_mask"].bool())
    assert lay["ids"].dtype == torch.long and lay["encoder_mask"].shape == (3, 16, 16)


def test_encoder_mask_drop_hides_the_source_from_the_target():
    known = torch.tensor([[True, True, False, False]])
    valid = torch.tensor([[True, True, True, False]])
    m = encoder_mask(known, valid, drop=torch.tensor([True]))
    assert m[0, 0].tolist() == [True, True, False, False]  # the source sees the source
    assert m[0, 2].tolist() == [False, False, True, False]  # the target sees neither source nor padding
    assert encoder_mask(known, valid)[0, 2].tolist() == [True, True, True, False]


def _run(net, ref, c, name):
    known_mask = ref["layout.cond_seq_mask"].bool() if c["conditional"] else None
    known = ref["sample.cond_seq"] if c["conditional"] else None
    draws = ref[f"{name}.sde_eps"] if c["method"] == "sde" else None
    g = torch.Generator().manual_seed(7) if draws is not None else None
    with torch.no_grad():
        z, _ = integrate(net, ref["sample.z0"].clone(), ref["sample.grid"], sampler=c["method"], gamma=c["gamma"],
                      omega=c["omega"], guidance=c["source_guidance"], known=known, known_mask=known_mask,
                      generator=g)
        ids = decode_tokens(net, z, c["omega"])
    return z, ids, draws


@pytest.mark.parametrize("name", ["cond_ode", "cond_ode_sc3", "cond_sde", "uncond_sde", "uncond_ode"])
def test_sampling_equals_the_authors_loop(net, ref, cases, name):
    c = cases[name]
    z, ids, draws = _run(net, ref, c, name)
    assert (z - ref[f"{name}.z_final"]).abs().max().item() < 1e-5
    assert torch.equal(ids, ref[f"{name}.decode_ids"])
    if draws is not None:  # the generator's draws are the ones the authors' loop made, in order
        g = torch.Generator().manual_seed(7)
        assert torch.equal(torch.stack([torch.randn(draws.shape[1:], generator=g) for _ in draws]), draws)
    if c["conditional"]:
        src_len = ref["layout.cond_seq_mask"].sum(1).long()
        out = extract_targets(ids, src_len, 16 - 8, EOS)
        assert torch.equal(out, ref[f"{name}.target_ids"])


def test_guidance_costs_a_second_pass_only_when_it_acts(net, ref):
    calls = []

    def counted(z, t, w, x_prev):
        calls.append(1)
        return net(z, t, w, x_prev)

    grid = ref["sample.grid"]
    known, mask = ref["sample.cond_seq"], ref["layout.cond_seq_mask"].bool()
    for guidance, known_, mask_, expected in ((2.0, known, mask, 12), (1.0, known, mask, 6), (2.0, None, None, 6)):
        calls.clear()
        with torch.no_grad():
            integrate(counted, ref["sample.z0"], grid, sampler="ode", guidance=guidance, known=known_, known_mask=mask_)
        assert len(calls) == expected


def test_extract_targets_by_hand():
    ids = torch.tensor([[5, 6, 30, 31, 1, 40, 41, 42], [8, 50, 51, 52, 53, 54, 55, 56]])
    out = extract_targets(ids, torch.tensor([2, 1]), keep=6, eos_id=EOS)
    assert out.tolist() == [[30, 31, 1, 1, 1, 1], [50, 51, 52, 53, 54, 55]]
    # positions past the row's end read EOS
    assert extract_targets(ids, torch.tensor([5, 4]), 6, EOS).tolist() == [[40, 41, 42, 1, 1, 1],
                                                                       [53, 54, 55, 56, 1, 1]]
