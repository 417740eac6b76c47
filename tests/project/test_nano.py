"""examples/nano_elf.py, the one-file ELF, against the library: the same initial weights from the same seed, and
with the same weights, inputs and draws the same forward passes, loss, gradients and samples."""

import importlib.util
from pathlib import Path

import pytest
import torch

from elflow.flow import Draw, Recipe, elf_loss
from elflow.model import ELF, get_config
from elflow.sampler import generate_tokens

NANO = Path(__file__).resolve().parents[2] / "examples" / "nano_elf.py"


@pytest.fixture(scope="module")
def nano():
    spec = importlib.util.spec_from_file_location("nano_elf", NANO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pair(nano, perturb: bool = True):
    """(nano network, library network) of the tiny preset's shape holding the same weights."""
    cfg = get_config("tiny")
    c = nano.Config(depth=cfg.depth, hidden=cfg.hidden, heads=cfg.heads, dim=cfg.dim, vocab_size=cfg.vocab_size,
                    max_length=cfg.max_length, bottleneck=cfg.bottleneck)
    torch.manual_seed(0)
    small = nano.ELF(c)
    if perturb:  # no zero head: every output depends on every weight
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in small.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    lib = ELF(cfg)
    lib.load_state_dict(small.state_dict())
    return small, lib


def test_the_same_seed_draws_the_same_initial_weights(nano):
    small, _ = pair(nano, perturb=False)
    torch.manual_seed(0)
    lib = ELF(get_config("tiny"))
    assert small.state_dict().keys() == lib.state_dict().keys()
    assert all(torch.equal(v, lib.state_dict()[k]) for k, v in small.state_dict().items())


@torch.no_grad()
def test_the_same_weights_give_the_same_denoise_and_decode_passes(nano):
    small, lib = pair(nano)
    g = torch.Generator().manual_seed(2)
    z, x_prev = torch.randn(3, 12, 32, generator=g), torch.randn(3, 12, 32, generator=g)
    t, w = torch.tensor([0.05, 0.5, 0.97]), torch.tensor([0.5, 1.0, 4.0])
    assert torch.allclose(small(z, t, w, x_prev), lib(z, t, w, x_prev), atol=1e-5, rtol=1e-5)
    assert torch.allclose(small(z, t, w, torch.zeros_like(z)), lib(z, t, w), atol=1e-5, rtol=1e-5)
    assert torch.allclose(small.decode(z, w), lib.decode(z, w), atol=1e-5, rtol=1e-5)


def test_the_same_draws_give_the_same_loss_and_gradients(nano):
    small, lib = pair(nano)
    B, L, C = 16, 12, 32
    g = torch.Generator().manual_seed(6)  # a draw with 4 decode, 4 self-conditioned and 8 plain rows
    x, tokens = torch.randn(B, L, C, generator=g), torch.randint(0, 100, (B, L), generator=g)
    d = nano.draw(B, L, C, g)
    assert d["decode"].any() and d["self_cond"].any() and (~d["decode"] & ~d["self_cond"]).any()
    draw = Draw(t=d["t"], omega=d["omega"], eps=d["eps"], p=d["p"], decode=d["decode"], self_cond=d["self_cond"],
                drop_source=torch.zeros(B, dtype=torch.bool), decode_rows=d["decode"].nonzero().flatten(),
                self_cond_rows=d["self_cond"].nonzero().flatten())
    mine = nano.elf_loss(small, x, tokens, d)
    theirs, _ = elf_loss(lib, x, tokens, draw, Recipe())
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-6)
    mine.backward()
    theirs.backward()
    grads = dict(lib.named_parameters())
    for name, p in small.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-6, rtol=1e-4), name
    assert any(p.grad.abs().sum() > 0 for p in small.decode_head.parameters())  # both branches trained


@pytest.mark.parametrize("steps", [1, 8])
def test_the_same_generator_gives_the_same_samples(nano, steps):
    small, lib = pair(nano)
    ids, z = nano.sample(small, 3, 12, steps=steps, gamma=1.5, omega=3.0, g=torch.Generator().manual_seed(4))
    ref_ids, ref_z = generate_tokens(lib, 3, 12, steps=steps, sampler="sde", gamma=1.5, omega=3.0,
                                     generator=torch.Generator().manual_seed(4), device="cpu")
    assert torch.allclose(z, ref_z, atol=1e-5, rtol=1e-5)
    assert torch.equal(ids, ref_ids)


def test_the_nano_file_stays_small():
    assert len(NANO.read_text().splitlines()) <= 400


def test_main_trains_and_samples_offline(nano, monkeypatch, tmp_path, capsys):
    """The file's own command, a few steps on the built-in corpus: it prints its losses and four samples."""
    monkeypatch.setenv("ELFLOW_CACHE", str(tmp_path / "cache"))
    nano.main(["--steps", "2", "--batch", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 2: loss ") and len(lines) == 5
    assert float(lines[0].split()[3]) > 0


@pytest.mark.parametrize("argv, says", [(["--steps", "0"], "--steps: expected an integer from 1"),
                                        (["--batch", "10**9"], "--batch: expected an integer, got"),
                                        (["--batch", "100000"], "--batch: expected an integer from 1 to 1,024"),
                                        (["--lr", "nan"], "--lr must be in (0, 1)")])
def test_main_refuses_bad_flags_in_one_line(nano, capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        nano.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and says in err[-1]
