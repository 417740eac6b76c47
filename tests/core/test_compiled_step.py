"""The training step as torch.compile sees it (on CPU): one graph with no break over the whole trained pass (the
frozen encoder, the self-conditioning pass, the trained pass, the loss), one compilation for every number of
decode and self-conditioned rows; the step's other parts: the TF32 setting and the background prefetch."""

import dataclasses

import pytest
import torch

from elflow.data.batches import Prefetch
from elflow.flow import Recipe, row_index
from elflow.methods import get_method
from elflow.methods.base import TrainedPass
from elflow.model import ELF, get_config
from elflow.space import build_space
from elflow.train import shard_generators


@pytest.fixture(scope="module")
def trained_pass(tiny_t5_dir):
    space = build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": 0.2})
    torch.manual_seed(0)
    net = ELF(get_config("tiny", dim=space.dim, vocab_size=space.vocab_size, max_length=16))
    batch = {"tokens": torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0)),
             "mask": torch.ones(4, 16, dtype=torch.bool)}
    return TrainedPass(get_method("elf"), net, space, Recipe()), batch


def with_rows(model, batch, decode: int, self_cond: int):
    """The draw of step 0 with its first `decode` rows decoded and the next `self_cond` rows self-conditioned."""
    g, c = shard_generators(0, 0, 0, "cpu")
    draw = model.draw(batch, g, c)
    dec, sc = torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)
    dec[:decode], sc[decode:decode + self_cond] = True, True
    return dataclasses.replace(draw, decode=dec, self_cond=sc, t=torch.where(dec, torch.ones_like(draw.t), draw.t),
                               decode_rows=row_index(dec, "cpu"), self_cond_rows=row_index(sc, "cpu"))


def test_the_whole_trained_pass_is_one_graph_without_a_break(trained_pass):
    """torch._dynamo.explain over the pass a training step compiles, with decode rows and self-conditioned rows
    (so the self-conditioning pass and the decode head both run): one graph, no break."""
    model, batch = trained_pass
    explained = torch._dynamo.explain(model)(batch, with_rows(model, batch, 1, 2))
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_a_changing_number_of_decode_and_self_conditioned_rows_compiles_once(trained_pass):
    """The row counts are data (flow.row_index marks them unbacked): one compilation serves every count, none
    included, and each compiled pass gives the plain pass's loss."""
    model, batch = trained_pass
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    for decode, self_cond in [(1, 2), (0, 3), (2, 0), (0, 0)]:
        draw = with_rows(model, batch, decode, self_cond)
        loss, sums = compiled(batch, draw)
        assert sums["decode_rows"] == decode
        assert torch.allclose(loss, model(batch, draw)[0], rtol=1e-5, atol=1e-6)
    assert len(graphs) == 1
    torch._dynamo.reset()


def test_tf32_is_set_for_cuda_devices_only_and_leaves_the_global_precision_readable():
    """use_tf32 on a CUDA device switches TF32 matmuls; torch.compile reads the global precision, which must
    stay readable (mixing torch's two precision interfaces makes reading it an error)."""
    from elflow.util.devices import use_tf32

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        use_tf32("cpu", True)
        assert torch.backends.cuda.matmul.allow_tf32 == before
        use_tf32("cuda", True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
        use_tf32(torch.device("cuda", 0), False)
        assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


class Counting:
    """Batches of rows numbered from 0 (a data iterator with a position); raises at batch `fail`."""

    def __init__(self, fail=None):
        self.n, self.fail = 0, fail

    def __next__(self):
        if self.n == self.fail:
            raise ValueError("a bad batch")
        self.n += 1
        return {"tokens": torch.arange((self.n - 1) * 4, self.n * 4)[:, None], "name": "x"}

    def state_dict(self):
        return {"position": self.n}


def test_the_prefetcher_gives_the_batches_in_order_with_the_position_after_each():
    ahead = Prefetch(Counting(), 3, micro=2, accum=2, pin=False)
    try:
        for step in range(3):
            shards, position = next(ahead)
            assert position == {"position": step + 1}  # read ahead, but each batch carries its own position
            assert [s["tokens"].flatten().tolist() for s in shards] == [[4 * step, 4 * step + 1],
                                                                       [4 * step + 2, 4 * step + 3]]
            assert shards[0]["name"] == "x"
    finally:
        ahead.close()
    failing = Prefetch(Counting(fail=1), 3, micro=4, accum=1, pin=False)
    try:
        next(failing)
        with pytest.raises(ValueError, match="a bad batch"):  # raised in the loop's thread
            next(failing)
    finally:
        failing.close()
