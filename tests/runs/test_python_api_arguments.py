"""The Python API checks what it is given: elflow.load, load_for_sampling and generate refuse a bad argument
with one ELFError line naming it, before anything is read or drawn, rather than ignoring it or failing deep
inside torch."""

import copy
import types

import pytest
import torch

import elflow
from elflow.flow import time_grid
from elflow.generate import SamplingSettings, generate
from elflow.runs.load import load, load_for_sampling
from elflow.sampler import integrate
from elflow.util.errors import ELFError


@pytest.fixture(scope="module")
def loaded(trained):
    return load_for_sampling(trained, device="cpu")


def one_line(e) -> str:
    line = str(e.value)
    assert "\n" not in line, line
    return line


LOAD_CASES = {  # id -> (keyword arguments over load(RUN), words of the line)
    "path-a-number": (dict(path_or_hub_id=123), ["must be a path or a hub id", "123"]),
    "path-empty": (dict(path_or_hub_id=""), ["must be a path or a hub id"]),
    "path-none": (dict(path_or_hub_id=None), ["must be a path or a hub id"]),
    "device-a-number-list": (dict(device=[0]), ["device must be 'cpu', 'cuda', 'cuda:N' or a torch.device"]),
    "device-meta": (dict(device=torch.device("meta")), ["device 'meta'", "cpu or cuda"]),
    "use-ema-a-text": (dict(use_ema="no"), ["use_ema must be True or False", "'no'"]),
    "max-length-zero": (dict(max_length=0), ["max_length must be None or a whole number >= 1"]),
    "max-length-a-fraction": (dict(max_length=2.5), ["max_length must be None or a whole number >= 1"]),
    "max-length-true": (dict(max_length=True), ["max_length must be None or a whole number >= 1"]),
}


@pytest.mark.parametrize("loader, case", [(loader, case) for loader in ("load", "load_for_sampling", "elflow.load")
                                          for case in sorted(LOAD_CASES)
                                          if not (loader == "elflow.load" and case.startswith("use-ema"))])
def test_a_bad_load_argument_is_one_line(trained, case, loader):
    """(the package's elflow.load takes no use_ema: it always loads the EMA)"""
    kw, words = LOAD_CASES[case]
    kw = {"path_or_hub_id": trained, **kw}
    fn = {"load": load, "load_for_sampling": load_for_sampling, "elflow.load": elflow.load}[loader]
    with pytest.raises(ELFError) as e:
        fn(kw.pop("path_or_hub_id"), **kw)
    line = one_line(e)
    for w in words:
        assert w in line, (w, line)


@pytest.mark.parametrize("space", [123, 1.5, ["t5"], object()], ids=["int", "float", "list", "object"])
def test_load_for_sampling_refuses_a_space_it_cannot_use(trained, space):
    """A space argument that is neither a spec, a folder / hub id nor a space object is refused, not ignored
    for the stored one."""
    with pytest.raises(ELFError, match="load_for_sampling: space must be None") as e:
        load_for_sampling(trained, device="cpu", space=space)
    one_line(e)


def _other_width_space(space):
    return types.SimpleNamespace(tokenizer=space.tokenizer, tokenize=space.tokenize, encode=space.encode,
                                 eos_id=space.eos_id, dim=space.dim + 1)


GENERATE_CASES = {  # id -> (change(net, space) -> generate's arguments, words of the line)
    "net-a-path": (lambda n, s: dict(net="runs/demo"), ["net must be an ELF network", "got str"]),
    "net-on-meta": (lambda n, s: dict(net=copy.deepcopy(n).to("meta")), ["weights are on meta", "cpu or cuda"]),
    "space-a-number": (lambda n, s: dict(space=123), ["space must be the network's embedding space", "got int"]),
    "space-of-another-width": (lambda n, s: dict(space=_other_width_space(s)), ["dimensions, the network's"]),
    "settings-a-dict": (lambda n, s: dict(settings={"steps": 2}), ["settings must be SamplingSettings, got dict"]),
    "sources-a-text": (lambda n, s: dict(sources="a b c"), ["sources must be a list of texts"]),
    "prompt-a-number": (lambda n, s: dict(prompt=5), ["prompt must be a text, got int"]),
    "part-past-the-ranks": (lambda n, s: dict(part=(1, 1)), ["part must be (rank, ranks)"]),
    "num-true": (lambda n, s: dict(num=True), ["number of samples must be >= 1, got True"]),
}


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_a_bad_generate_argument_is_one_line(loaded, case):
    net, space = loaded
    change, words = GENERATE_CASES[case]
    kw = {"net": net, "space": space, "num": 2, "settings": SamplingSettings(steps=2), "progress": False,
          **change(net, space)}
    with pytest.raises(ELFError) as e:
        generate(**kw)
    line = one_line(e)
    for w in words:
        assert w in line, (w, line)


def test_the_loaded_network_refuses_bad_integrate_arguments_as_the_log_ran_them(loaded):
    """integrate on a loaded run: z0 of the wrong width, on the meta device, NaN, a reversed or NaN grid."""
    net, _ = loaded
    grid = time_grid(4, "uniform")
    for z0, g, words in ((torch.zeros(2, 16, 7), grid, "channels per position"),
                         (torch.zeros(2, 16, 32, device="meta"), grid, "meta device"),
                         (torch.full((2, 16, 32), float("nan")), grid, "NaN or infinite"),
                         (torch.zeros(2, 16, 32), torch.tensor([1.0, 0.5, 0.0]), "rising"),
                         (torch.zeros(2, 16, 32), torch.tensor([0.0, float("nan"), 1.0]), "finite")):
        with pytest.raises(ELFError, match=words), torch.no_grad():
            integrate(net, z0, g)
    with torch.no_grad():  # a good call still samples
        z, x = integrate(net, 2 * torch.randn(2, 16, 32), grid)
    assert torch.isfinite(z).all() and generate(net, loaded[1], 2, SamplingSettings(steps=2), progress=False)
