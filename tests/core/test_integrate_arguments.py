"""sampler.integrate checks what it is given once, before its loop: a bad argument is one ELFError line naming it,
never a raw torch error deep in the network, a NaN result or an integration run backwards."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elflow.flow import time_grid
from elflow.model import ELF, get_config
from elflow.sampler import integrate
from elflow.util.errors import ELFError


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return ELF(get_config("tiny", max_length=16)).eval()  # dim 32, 16 positions


def z(*shape, fill=0.0, **kw):
    return torch.full(shape or (2, 8, 32), fill, **kw)


NAN, INF = float("nan"), float("inf")
# id -> (integrate's arguments over a good call, words of the line)
BAD = {
    "z0-of-another-width": (dict(z0=z(2, 16, 7)), ["z0 has 7 channels per position", "(B, L, 32)"]),
    "z0-of-two-dimensions": (dict(z0=z(2, 32)), ["z0 must be a non-empty 3-D tensor", "(2, 32)"]),
    "z0-empty": (dict(z0=z(0, 8, 32)), ["z0 must be a non-empty 3-D tensor"]),
    "z0-longer-than-the-network": (dict(z0=z(1, 17, 32)), ["17 positions, more than the 16"]),
    "z0-of-integers": (dict(z0=z(2, 8, 32, dtype=torch.long)), ["floating-point", "torch.int64"]),
    "z0-nan": (dict(z0=z(2, 8, 32, fill=NAN)), ["z0 holds NaN or infinite values"]),
    "z0-inf": (dict(z0=z(2, 8, 32, fill=INF)), ["z0 holds NaN or infinite values"]),
    "z0-on-meta": (dict(z0=z(2, 8, 32, device="meta")), ["z0 is on the meta device"]),
    "z0-a-list": (dict(z0=[[[0.0] * 32]]), ["z0 must be a torch.Tensor, got list"]),
    "grid-reversed": (dict(grid=torch.tensor([1.0, 0.5, 0.0])), ["time grid", "rising", "[1.0, 0.5, 0.0]"]),
    "grid-nan": (dict(grid=torch.tensor([0.0, NAN, 1.0])), ["time grid", "finite"]),
    "grid-past-one": (dict(grid=torch.tensor([0.0, 2.0])), ["time grid", "in [0, 1]"]),
    "grid-one-time": (dict(grid=torch.tensor([0.0])), ["at least two"]),
    "grid-two-dimensional": (dict(grid=torch.zeros(2, 2)), ["grid must be a non-empty 1-D tensor"]),
    "grid-on-meta": (dict(grid=torch.zeros(3, device="meta")), ["grid is on the meta device"]),
    "grid-a-list": (dict(grid=[0.0, 1.0]), ["grid must be a torch.Tensor"]),
    "sampler-unknown": (dict(sampler="heun"), ["unknown sampler 'heun'"]),
    "gamma-negative": (dict(gamma=-1.0), ["gamma must be"]),
    "gamma-nan": (dict(gamma=NAN), ["gamma must be"]),
    "guidance-inf": (dict(guidance=INF), ["guidance must be"]),
    "omega-nan": (dict(omega=NAN), ["omega must be"]),
    "omega-a-string": (dict(omega="3"), ["omega must be"]),
    "omega-tensor-of-another-batch": (dict(omega=torch.ones(3)), ["omega tensor must hold 2 values (one per row)"]),
    "omega-tensor-nan": (dict(omega=torch.full((2,), NAN)), ["omega tensor must hold 2 values", "each a number "
                                                                                               "from 0 to 100"]),
    "omega-tensor-negative": (dict(omega=torch.full((2,), -5.0)), ["values from -5 to -5"]),
    "known-mask-soft": (dict(known=z(2, 8, 32), known_mask=torch.full((2, 8), 0.5)),
                        ["known_mask must be a bool tensor", "only 0 and 1"]),
    "known-without-its-mask": (dict(known=z(2, 8, 32)), ["known and known_mask go together"]),
    "known-of-another-shape": (dict(known=z(2, 4, 32), known_mask=torch.ones(2, 4, dtype=torch.bool)),
                               ["known must have z0's shape (2, 8, 32)"]),
    "known-nan": (dict(known=z(2, 8, 32, fill=NAN), known_mask=torch.ones(2, 8, dtype=torch.bool)),
                  ["known must hold finite"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_argument_is_one_line_naming_it(net, case):
    given_args, words = BAD[case]
    args = {"z0": z(2, 8, 32), "grid": time_grid(4, "uniform"), **given_args}
    with pytest.raises(ELFError) as e, torch.no_grad():
        integrate(net, args.pop("z0"), args.pop("grid"), **args)
    line = str(e.value)
    assert "\n" not in line and line.startswith("integrate: "), line
    for w in words:
        assert w in line, (w, line)


@pytest.mark.parametrize("omega, words", [(NAN, "omega must be a number from 0 to 100, got nan"),
                                          (-5.0, "omega must be a number from 0 to 100, got -5.0"),
                                          (torch.tensor([3.0, NAN]), "an omega tensor must hold 2 values"),
                                          (torch.ones(3), "an omega tensor must hold 2 values")])
def test_the_readout_checks_omega_as_the_sampler_does(net, omega, words):
    """decode_tokens with omega NaN returned token 0 everywhere, and took -5: the one omega check refuses both."""
    from elflow.sampler import decode_tokens

    with pytest.raises(ELFError) as e, torch.no_grad():
        decode_tokens(net, z(2, 8, 32), omega)
    assert str(e.value).startswith("decode_tokens: ") and words in str(e.value)
    with torch.no_grad():  # 0 and 1 in a mask of another dtype are a mask; a bool mask as before
        assert decode_tokens(net, z(2, 8, 32), 3.0).shape == (2, 8)
        for mask in (torch.ones(2, 8), torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.bool)):
            integrate(net, z(2, 8, 32), time_grid(2, "uniform"), known=z(2, 8, 32), known_mask=mask)


def test_what_it_took_before_still_samples(net):
    """A float16 z0 (computed in the network's precision), a grid that starts past 0 (a partial path), a grid
    with a repeated time, a plain function in place of a network: accepted, finite results."""
    with torch.no_grad():
        for z0, grid in ((torch.randn(2, 8, 32).half(), time_grid(4, "uniform")),
                         (torch.randn(2, 8, 32), torch.tensor([0.1, 0.12, 1.0])),
                         (torch.randn(2, 8, 32), torch.tensor([0.0, 0.5, 0.5, 1.0]))):
            out, last = integrate(net, z0, grid)
            assert torch.isfinite(out.float()).all() and torch.isfinite(last.float()).all()
        out, _ = integrate(lambda z_, t_, w_, xp: 0.5 * z_, torch.randn(3, 1, 2), time_grid(3, "uniform"),
                           sampler="ode")
        assert out.shape == (3, 1, 2)


times = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                  st.floats(min_value=0.0, max_value=1.0, width=32))


@settings(max_examples=80, deadline=None)
@given(grid=st.lists(times, min_size=0, max_size=5))
def test_every_grid_samples_or_is_refused_in_one_line(net, grid):
    """Any list of times: a grid of two or more finite times in [0, 1] that never falls samples (finite
    results); any other is an ELFError naming the grid, never a NaN sample or another exception."""
    good = len(grid) >= 2 and all(math.isfinite(t) and 0 <= t <= 1 for t in grid) and \
        all(a <= b for a, b in zip(grid, grid[1:]))
    z0 = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if good:
            out, _ = integrate(net, z0, torch.tensor(grid, dtype=torch.float32), sampler="sde")
            assert torch.isfinite(out).all()
        else:
            with pytest.raises(ELFError, match="^integrate: (the time )?grid"):
                integrate(net, z0, torch.tensor(grid, dtype=torch.float32), sampler="sde")
