"""elflow's conditional training step (`train.train_step` on pairs) against the released step re-written in
tests/authors_cond_step.py, on the same batch, weights and draws, with the decode branch on: the loss, every
gradient, and the optimiser's step of every parameter, Muon and Adam."""

import copy

import pytest
import torch
from authors_cond_step import authors_cond_loss, clip_by_global_norm, released_encoder_mask, released_first_step

from elflow.flow import Recipe
from elflow.methods.base import TrainedPass
from elflow.methods.elf import METHOD
from elflow.model import ELF, get_config
from elflow.optim import ELFOptimizer
from elflow.train import shard_generators, train_step

EOS, LR, SEED_FROM = 1, 1e-3, 0


class ContextSpace(torch.nn.Module):
    """A stand-in frozen encoder whose output depends on its attention: a position's vector plus the mean of
    the context vectors of the keys it may see (so that the encoder mask of pairs matters)."""

    trainable = False

    def __init__(self, vocab: int, dim: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.dim = dim
        self.register_buffer("table", torch.randn(vocab, dim, generator=g))
        self.register_buffer("context", torch.randn(vocab, dim, generator=g))

    def encode(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        a = attention_mask.float()  # (B, L, L)
        return self.table[tokens] + a @ self.context[tokens] / a.sum(-1, keepdim=True).clamp_min(1)  # (B, L, C)


def pairs_batch(B: int = 16, L: int = 16, vocab: int = 100, seed: int = 0) -> dict:
    """Rows of a source (3-7 ids) and its target (4-9 ids), EOS-padded to L, as the pair store serves them:
    the loss covers every position but the source, the EOS padding included."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(L)[None, :]
    src = torch.randint(3, 8, (B, 1), generator=g)
    end = src + torch.randint(4, 10, (B, 1), generator=g)
    known, valid = pos < src, pos < end
    tokens = torch.where(valid, torch.randint(2, vocab, (B, L), generator=g), EOS)
    return {"tokens": tokens, "mask": torch.ones(B, L, dtype=torch.bool), "attention_mask": valid, "known": known}


def a_seed_with_every_kind_of_row(batch, space, recipe) -> int:
    """The first run seed whose draw of step 0 has decode, self-conditioned, plain denoise and source-dropped
    rows."""
    for seed in range(SEED_FROM, SEED_FROM + 200):
        g, c = shard_generators(seed, 0, 0, "cpu")
        d = METHOD.draw(batch, space, recipe, g, c)
        if d.decode.any() and d.self_cond.any() and d.drop_source.any() and (~d.decode & ~d.self_cond).any():
            return seed
    raise AssertionError("no seed draws every kind of row")


def tiny_network() -> ELF:
    torch.manual_seed(0)
    net = ELF(get_config("tiny", max_length=16))
    torch.nn.init.normal_(net.x_head.weight, std=0.02)  # zero-initialised; a trained one is not
    return net


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def steps():
    """(elflow's step, the released step) of one batch: loss, gradients (clipped at 1.0) and the weights'
    change, from the same initial weights."""
    recipe = Recipe(decode_noise_scale=1.0)  # the conditional tasks' decode corruption; source drop 0.1
    net, space, batch = tiny_network(), ContextSpace(100, 32), pairs_batch()
    seed = a_seed_with_every_kind_of_row(batch, space, recipe)
    start = copy.deepcopy(net)

    # elflow: the trainer's step on this one shard
    opt = ELFOptimizer(list(net.named_parameters()), lr=LR, ns_dtype=torch.float32, ns_method="iterate")
    seen, optimiser_step = {}, opt.step

    def recording_step():
        seen.update({n: p.grad.detach().clone() for n, p in net.named_parameters()})
        optimiser_step()

    opt.step = recording_step
    totals = train_step(TrainedPass(METHOD, net, space, recipe), [batch], opt, None, step=0, seed=seed,
                        first_shard=0, dtype="fp32", grad_clip=1.0)
    moved = {n: p0.detach() - p.detach() for (n, p0), p in zip(start.named_parameters(), net.parameters())}

    # the released step on the same draws
    g, c = shard_generators(seed, 0, 0, "cpu")
    d = METHOD.draw(batch, space, recipe, g, c)
    with torch.no_grad():
        x = space.encode(batch["tokens"], released_encoder_mask(batch["known"], batch["attention_mask"],
                                                                d.drop_source))
    loss = authors_cond_loss(start, x, batch["tokens"], batch["known"], d, recipe, valid=batch["mask"])
    loss.backward()
    grads = clip_by_global_norm({n: p.grad for n, p in start.named_parameters()}, 1.0)
    return {"loss": totals["loss"], "grads": seen, "moved": moved, "muon": opt.muon_names, "adam": opt.adam_names,
            "draw": d}, \
        {"loss": loss.detach(), "grads": grads}


def test_the_draw_has_every_kind_of_row(steps):
    d = steps[0]["draw"]
    assert d.decode.any() and d.self_cond.any() and d.drop_source.any()


def test_loss_and_every_gradient_equal_the_released_step(steps):
    mine, released = steps
    assert mine["loss"].item() == pytest.approx(released["loss"].item(), rel=1e-6)
    for name, g in released["grads"].items():
        assert rel(mine["grads"][name], g) < 1e-5, name


def test_every_step_equals_the_released_optimisers(steps):
    """From the same (clipped) gradient, every parameter's first step: Muon on the matrices, the decode head's
    two included (fan rule on their true fans, whichever way they are stored), Nesterov-Adam on the rest
    (1e-3 for Muon: fp32 Newton-Schulz in two evaluation orders; 1e-4 for Adam: a step of 1.5e-3 read as the
    difference of two fp32 weights near 1 keeps about 4e-5 of it)."""
    mine, _ = steps
    assert len(mine["muon"]) > 15 and len(mine["adam"]) > 15
    for name in mine["muon"] + mine["adam"]:
        expected = released_first_step(name, mine["grads"][name], LR)
        assert rel(mine["moved"][name], expected) < (1e-3 if name in mine["muon"] else 1e-4), name
