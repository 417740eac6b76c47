"""The paper's ablations as run options: the prediction target, adaLN-Zero conditioning, the bottleneck, the
optimiser, the recipe's constants. Each trains a tiny model a few steps, is saved, loaded and sampled."""

import json

import pytest
import torch
from helpers import x_to_prediction

from elflow.model import ELF, get_config, num_params, prediction_to_x


# -- the prediction targets -------------------------------------------------------------------------------
@pytest.mark.parametrize("noise_scale,t_eps", [(2.0, 0.05), (1.3, 0.1)])
def test_prediction_conversions_are_exact_inverses_and_match_the_path(noise_scale, t_eps):
    """On random tensors: x -> target -> x and target -> x -> target give back the input for v and eps (at
    every t, the clipped ends included); inside the clip, the targets of a point z = t x + (1 - t) s eps on the
    path are the path's own: eps itself and v = x - s eps."""
    g = torch.Generator().manual_seed(0)
    B, L, C = 64, 5, 7
    x, eps = torch.randn(B, L, C, generator=g), torch.randn(B, L, C, generator=g)
    t = torch.cat([torch.rand(B - 4, generator=g), torch.tensor([0.0, 1.0, t_eps / 2, 1 - t_eps / 2])])
    tt = t[:, None, None]
    z = tt * x + (1 - tt) * noise_scale * eps
    for kind in ("x", "v", "eps"):
        out = x_to_prediction(kind, x, z, t, noise_scale, t_eps)
        back = prediction_to_x(kind, out, z, t, noise_scale, t_eps)
        assert torch.allclose(back, x, atol=1e-5, rtol=1e-5), kind
        r = torch.randn(B, L, C, generator=g)
        assert torch.allclose(x_to_prediction(kind, prediction_to_x(kind, r, z, t, noise_scale, t_eps), z, t,
                                              noise_scale, t_eps), r, atol=1e-4, rtol=1e-4), kind
    inside = (t > t_eps) & (t < 1 - t_eps)
    assert torch.allclose(x_to_prediction("eps", x, z, t, noise_scale, t_eps)[inside], eps[inside], atol=1e-4)
    assert torch.allclose(x_to_prediction("v", x, z, t, noise_scale, t_eps)[inside],
                          (x - noise_scale * eps)[inside], atol=1e-4)


@pytest.mark.parametrize("predict", ["v", "eps"])
def test_a_v_or_eps_head_is_turned_into_x_inside_the_network(predict):
    """The network's output is x whatever its head predicts: the head's raw output, converted by the config's
    noise scale and clip, equals what net(...) returns."""
    torch.manual_seed(0)
    cfg = get_config("tiny", dim=8, vocab_size=20, max_length=6, predict=predict, noise_scale=1.5, t_eps=0.05)
    net = ELF(cfg).eval()
    torch.nn.init.normal_(net.x_head.weight)
    z, t, w = torch.randn(3, 6, 8), torch.tensor([0.02, 0.5, 0.99]), torch.full((3,), 2.0)
    h = net.trunk(z, t, w, None, torch.zeros(3))
    raw = net.x_head(net.final_norm(h.float()))
    assert torch.allclose(net(z, t, w), prediction_to_x(predict, raw, z, t, 1.5, cfg.t_eps), atol=1e-6)


# -- adaLN-Zero -------------------------------------------------------------------------------------------
def test_adaln_zero_starts_as_the_identity_and_its_count_at_elf_b_size():
    """A fresh adaLN network: every block returns its input (the modulation is zero-initialised, so every
    gate is 0) and there are no prefix tokens. At ELF-B size it has the prefix network's parameters less the
    12 prefix tokens plus, per block, a (H -> 6H) map, a (H -> 2H) map on the head and the mode vector."""
    torch.manual_seed(0)
    cfg = get_config("tiny", dim=8, vocab_size=20, max_length=6, conditioning="adaln")
    net = ELF(cfg).eval()
    assert cfg.num_prefix == 0 and not hasattr(net, "time_tokens")
    seen = []
    for block in net.blocks:
        block.register_forward_hook(lambda m, args, out: seen.append(torch.equal(args[0], out)))
    net(torch.randn(2, 6, 8), torch.rand(2), torch.full((2,), 3.0), torch.randn(2, 6, 8))
    assert seen == [True] * cfg.depth

    tokens = ELF(get_config("elf-b", dim=512, vocab_size=32100, max_length=8))
    adaln = ELF(get_config("elf-b", dim=512, vocab_size=32100, max_length=8, conditioning="adaln"))
    H, D, P = 768, 12, 12
    expected = num_params(tokens) - P * H + D * (H * 6 * H + 6 * H) + (H * 2 * H + 2 * H) + H
    assert num_params(adaln) == expected
    print(f"ELF-B parameters: prefix tokens {num_params(tokens) / 1e6:.1f}M, adaLN-Zero {num_params(adaln) / 1e6:.1f}M")


# -- each option trains, saves, loads and samples -----------------------------------------------------------
OPTIONS = {
    "predict-v": (["--predict", "v"], {"predict": "v"}),
    "predict-eps": (["--predict", "eps", "--noise-scale", "1.5"], {"predict": "eps", "noise_scale": 1.5}),
    "adaln": (["--conditioning", "adaln"], {"conditioning": "adaln"}),
    "bottleneck": (["--bottleneck", "8"], {"bottleneck": 8}),
    "adamw": (["--optimizer", "adamw"], {}),
    "recipe": (["--noise-scale", "1.5", "--t-mean", "-0.5", "--t-std", "1.2", "--decode-prob", "0.4",
                "--omega-low", "1", "--omega-high", "3"], {}),
    "no-self-cond": (["--self-cond-prob", "0"], {"self_cond": False}),
}


@pytest.fixture(scope="module")
def base_args(tmp_path_factory, tiny_corpus_file):
    cache = tmp_path_factory.mktemp("cache")
    return ["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--length", "16", "--batch", "4",
            "--steps", "3", "--warmup", "1", "--ckpt-every", "3", "--dtype", "fp32", "--quiet",
            "--cache-dir", str(cache)]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_trains_saves_loads_and_samples(name, base_args, tmp_path):
    from elflow.cli import main
    from elflow.runs.load import load_for_sampling

    flags, network = OPTIONS[name]
    run = tmp_path / "run"
    assert main(base_args + flags + ["--out", str(run)]) == 0
    stored = json.loads((run / "run.json").read_text())["train"]
    net, space = load_for_sampling(run, device="cpu")
    for key, value in network.items():
        assert getattr(net.config, key) == value, key
    if name == "adamw":
        assert stored["optimizer"] == "adamw" and stored["lr"] == pytest.approx(5e-5 * 4 / 256)
        opt = torch.load(next((run / "checkpoints").iterdir()) / "optimizer.pt", weights_only=True)
        (adamw,) = opt["optimizer"]  # one AdamW over every parameter, no Muon
        assert sum(len(g["params"]) for g in adamw["param_groups"]) == len(list(net.parameters()))
        assert all("ns_steps" not in g and "betas" in g for g in adamw["param_groups"])
    if name == "recipe":
        from elflow.flow import Recipe

        assert net.record.recipe.to_dict() == Recipe(noise_scale=1.5, t_mean=-0.5, t_std=1.2, decode_prob=0.4, omega_low=1.0,
                                          omega_high=3.0).to_dict()
        assert net.record.recipe.noise_scale == 1.5
    if name == "no-self-cond":
        assert not hasattr(net, "self_cond_proj") and net.record.sampling.omega == 1.0
    out = tmp_path / "s.jsonl"
    assert main(["sample", str(run), "--steps", "3", "--num", "2", "--quiet", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and all(isinstance(r["text"], str) for r in records)
    if name == "no-self-cond":
        assert all(r["omega"] == 1.0 for r in records)


@pytest.mark.parametrize("flags,message", [
    (["--method", "ar", "--predict", "v"], "--predict applies to ELF runs only"),
    (["--method", "mdlm", "--noise-scale", "1"], "--noise-scale applies to ELF runs only"),
    (["--optimizer", "adamw", "--adam-heads"], "--adam-heads sets up Muon"),
    (["--source-drop-prob", "0.2"], "--source-drop-prob applies to runs on (source, target) pairs"),
    (["--predict", "eps", "--skip", "gaussian"], "it needs --predict x"),
    (["--omega-low", "3", "--omega-high", "2"], "omega_low <= omega_high"),
    (["--decode-prob", "1.5"], "--decode-prob must be a number in [0, 1]"),
])
def test_combinations_that_cannot_work_are_one_line(flags, message, base_args, tmp_path, capsys):
    from elflow.cli import main

    capsys.readouterr()
    code = main(base_args + flags + ["--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


# -- the separate decoder -----------------------------------------------------------------------------------
def test_a_separate_decoder_trains_in_two_stages_and_is_one_model(base_args, tmp_path, capsys):
    """--decoder separate: the first stage (OUT/decoder) trains a network in decode mode alone; the second
    trains a denoiser (no readout of its own) against it, frozen. The run's checkpoint holds both as one
    model: its decoder is the first stage's EMA weights, unchanged by the second stage; it loads and samples;
    --decoder-from takes the same decoder from a finished stage and gives the same run, and so does a run
    stopped inside its first stage and resumed."""
    from safetensors.torch import load_file

    from elflow.cli import main
    from elflow.model import SeparateDecoderELF
    from elflow.runs.load import load_for_sampling

    args = base_args[:base_args.index("--steps")] + base_args[base_args.index("--steps") + 2:]
    run = tmp_path / "sep"
    assert main(args + ["--steps", "4", "--decoder", "separate", "--decoder-steps", "2", "--ckpt-every", "2",
                        "--out", str(run)]) == 0
    stage = json.loads((run / "decoder" / "run.json").read_text())
    assert stage["record"]["network"]["decoder"] == "shared" and stage["train"]["steps"] == 2 and \
        stage["record"]["recipe"]["decode_prob"] == 1.0
    assert json.loads((run / "run.json").read_text())["record"]["recipe"]["decode_prob"] == 0.0  # all denoise
    first = load_file(run / "decoder" / "checkpoints" / "step_0000002" / "ema.safetensors")
    for step in (2, 4):
        for part in ("model", "ema"):
            w = load_file(run / "checkpoints" / f"step_{step:07d}" / f"{part}.safetensors")
            assert all(torch.equal(w["decoder." + k], v) for k, v in first.items())
            assert not any(k.startswith("denoiser.decode_head") for k in w)
    net, space = load_for_sampling(run, device="cpu")
    assert isinstance(net, SeparateDecoderELF)
    z = torch.randn(2, 16, net.config.dim)
    w = torch.full((2,), 3.0)
    assert torch.equal(net.decode(z, w), net.decoder.decode(z, w))
    assert main(["sample", str(run), "--steps", "3", "--num", "2", "--quiet", "--out", str(tmp_path / "s.jsonl")]) == 0

    part = tmp_path / "part"
    assert main(args + ["--steps", "4", "--decoder", "separate", "--decoder-from", str(run / "decoder"),
                        "--ckpt-every", "2", "--out", str(part)]) == 0
    a = load_file(run / "checkpoints" / "step_0000004" / "ema.safetensors")
    b = load_file(part / "checkpoints" / "step_0000004" / "ema.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same decoder, the same run

    from elflow.lifecycle.claim import stored_config
    from elflow.train import train

    stopped = tmp_path / "stopped"  # stopped inside the first stage, resumed from the command line
    cache = base_args[base_args.index("--cache-dir") + 1]
    train(stored_config(run), stopped, cache_dir=cache, quiet=True, stop_after=1)
    assert main(["train", "--out", str(stopped), "--resume", "--quiet", "--cache-dir", cache]) == 0
    c = load_file(stopped / "checkpoints" / "step_0000004" / "ema.safetensors")
    assert all(torch.equal(a[k], c[k]) for k in a)

    capsys.readouterr()
    for flags, message in ((["--decoder", "separate", "--method", "ar"], "--decoder applies to ELF runs only"),
                           (["--decoder", "separate", "--decode-prob", "0.3"], "--decode-prob does not go with"),
                           (["--decoder-steps", "3"], "--decoder-steps needs --decoder separate")):
        assert main(args + ["--steps", "4", *flags, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
