"""elflow's network reproduces the authors' released PyTorch port exactly (their reference vectors, tests/reference)."""


import json

import pytest
import torch
from helpers import built_from, elflow_to_official, reference_dir
from safetensors.torch import load_file

from elflow.runs.released import read_released_checkpoint, released_to_elflow
from elflow.util.errors import ELFError

REF = reference_dir("official_tiny.safetensors", "checkpoint_7")

TOL = 1e-5



@pytest.fixture(scope="module")
def ref():
    return load_file(REF / "official_tiny.safetensors")


@pytest.fixture(scope="module")
def net(ref):
    sd = released_to_elflow({k[len("params."):]: v for k, v in ref.items() if k.startswith("params.")})
    return built_from(sd).eval()


def close(a, b):
    return (a - b).abs().max().item()


def test_inferred_shape(net):
    c = net.config
    assert (c.depth, c.hidden, c.heads, c.dim, c.vocab_size, c.bottleneck) == (4, 64, 4, 32, 100, 16)
    assert c.mlp_hidden == 170 and c.num_prefix == 12


def test_rope_tables_match(net, ref):
    assert close(net.rope_cos, ref["buffers.feat_rope.freqs_cos"]) < 1e-6
    assert close(net.rope_sin, ref["buffers.feat_rope.freqs_sin"]) < 1e-6


@torch.no_grad()
def test_denoise_outputs(net, ref):
    z, xp, t, w = ref["in.z"], ref["in.x_prev"], ref["in.t"], ref["in.w"]
    assert close(net(z, t, w, x_prev=xp), ref["out.denoise_sc"]) < TOL
    assert close(net(z, t, w), ref["out.denoise_nosc"]) < TOL  # x_prev None = zeros


@torch.no_grad()
def test_decode_outputs(net, ref):
    z, t, w = ref["in.z_decode"], ref["in.t_decode"], ref["in.w_decode"]
    assert (t == 1).all()  # the reference's decode pass is at t = 1, as net.decode is
    assert close(net.decode(z, w), ref["out.decode_logits"]) < TOL
    x, logits = net.mixed(z, t, w, None, torch.ones(len(t)), torch.arange(len(t)))
    assert close(x, ref["out.decode_x"]) < TOL and close(logits, ref["out.decode_logits"]) < TOL


@torch.no_grad()
def test_mixed_per_row_gate(net, ref):
    h = net.trunk(ref["in.z"], ref["in.t_mixed"], ref["in.w"], ref["in.x_prev"], ref["in.decoder_step_active_mixed"])
    assert close(net.denoise_head(h, ref["in.z"], ref["in.t_mixed"]), ref["out.mixed_x"]) < TOL
    assert close(net.logits_head(h), ref["out.mixed_logits"]) < TOL


@torch.no_grad()
def test_plain_input_without_self_conditioning(ref):
    sd = released_to_elflow({k[len("params."):]: v for k, v in ref.items() if k.startswith("params.")})
    sd = {k: v for k, v in sd.items() if not k.startswith("self_cond_proj")}
    plain = built_from(sd).eval()
    assert not plain.config.self_cond
    assert close(plain(ref["in.z"], ref["in.t"], ref["in.w"]), ref["out.denoise_plain_c"]) < TOL


@torch.no_grad()
def test_released_checkpoint_file_uses_ema(ref):
    sd = read_released_checkpoint(REF / "checkpoint_7")
    net = built_from(sd).eval()
    assert close(net(ref["in.z"], ref["in.t"], ref["in.w"], x_prev=ref["in.x_prev"]), ref["out.denoise_sc"]) < TOL
    # a folder resolves to its checkpoint_<N>
    assert read_released_checkpoint(REF).keys() == sd.keys()


def test_key_map_round_trip(ref):
    theirs = {k[len("params."):]: v for k, v in ref.items() if k.startswith("params.")}
    back = elflow_to_official(released_to_elflow(theirs))
    assert back.keys() == theirs.keys()
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)


def test_unknown_key_is_refused(ref):
    theirs = {k[len("params."):]: v for k, v in ref.items() if k.startswith("params.")}
    theirs["blocks.0.attn.extra.weight"] = torch.zeros(2)
    with pytest.raises(ELFError, match="unexpected keys"):
        released_to_elflow(theirs)


def test_wrong_shape_is_refused(ref):
    sd = released_to_elflow({k[len("params."):]: v for k, v in ref.items() if k.startswith("params.")})
    sd["blocks.1.mlp.w3.weight"] = torch.zeros(64, 99)
    with pytest.raises(ELFError):
        built_from(sd)


@torch.no_grad()
def test_convert_writes_an_elflow_run_with_the_same_network(ref, tmp_path):
    from elflow import load as load_network
    from elflow.cli import main
    from elflow.runs.stored import run_file

    out = tmp_path / "converted"
    out.mkdir()  # an empty folder is written into
    assert main(["convert", str(REF / "checkpoint_7"), str(out), "--max-length", "16"]) == 0
    ckpt = out / "checkpoints" / "step_0000007"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "run.json"]
    assert (ckpt / "model.safetensors").exists() and (ckpt / "ema.safetensors").exists()
    assert not (ckpt / "optimizer.pt").exists()  # it samples, it does not resume
    stored = run_file(out)
    assert stored["train"] is None and stored["record"].network.max_length == 16
    assert json.loads((out / "run.json").read_text())["converted_from"] == str(REF / "checkpoint_7")
    net = load_network(out)
    assert net.record == stored["record"] and load_network(ckpt).record == stored["record"]
    assert close(net(ref["in.z"], ref["in.t"], ref["in.w"], x_prev=ref["in.x_prev"]), ref["out.denoise_sc"]) < TOL
    import elflow

    direct = elflow.load(REF / "checkpoint_7", max_length=16)
    assert not direct.training
    assert close(direct(ref["in.z"], ref["in.t"], ref["in.w"]), ref["out.denoise_nosc"]) < TOL


def test_a_release_without_self_conditioning_loads_with_a_recipe_that_never_self_conditions(ref, tmp_path):
    """Weights without the self-conditioning input were trained with self_cond_prob 0: the record of such a
    release says so (its network's self_cond follows from its recipe), and the network reproduces the authors'
    plain output; it samples with omega 1 by default (nothing for omega to guide by without self-conditioning)."""
    import elflow

    ckpt = torch.load(REF / "checkpoint_7", weights_only=True)
    plain = {which: {k: v for k, v in ckpt[which].items() if not k.startswith("self_cond_proj")}
             for which in ("params", "ema_params1")}
    assert plain["params"].keys() < ckpt["params"].keys()
    (tmp_path / "release").mkdir()
    torch.save(plain, tmp_path / "release" / "checkpoint_7")
    net = elflow.load(tmp_path / "release" / "checkpoint_7", max_length=16)
    assert net.record.recipe.self_cond_prob == 0.0 and not net.config.self_cond
    assert net.record.sampling.omega == 1.0
    assert close(net(ref["in.z"], ref["in.t"], ref["in.w"]), ref["out.denoise_plain_c"]) < TOL


def test_files_that_are_not_checkpoints_are_refused(tmp_path):
    import pickle

    junk = tmp_path / "checkpoint_3"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ELFError, match="cannot be read as a tensors-only checkpoint"):
        read_released_checkpoint(junk)

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    evil = tmp_path / "evil" / "checkpoint_1"
    evil.parent.mkdir()
    evil.write_bytes(pickle.dumps({"params": Evil()}))
    with pytest.raises(ELFError, match="never unpickles"):
        read_released_checkpoint(evil.parent)
    torch.save({"weights": {}}, tmp_path / "checkpoint_9")
    with pytest.raises(ELFError, match="not an ELF checkpoint"):
        read_released_checkpoint(tmp_path / "checkpoint_9")


def test_sampling_from_an_authors_checkpoint_with_a_local_t5_folder(tiny_t5_dir, tmp_path):
    """The authors' format goes straight into `elflow sample`, with a local T5 folder standing in for t5-small."""
    import json

    from elflow.cli import main

    out = tmp_path / "s.jsonl"
    rc = main(["sample", str(REF / "checkpoint_7"), "--encoder", str(tiny_t5_dir), "--length", "16", "--steps", "3",
               "--num", "2", "--quiet", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 and all(isinstance(r["text"], str) and r["ema"] for r in rows)
