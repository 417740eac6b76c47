"""What a training method is to the trainer, the loader and the samplers: the `Method` protocol, and
`TrainedPass`, a method's loss as one module's forward (what DDP and torch.compile wrap)."""

from __future__ import annotations

import torch
from torch import nn

from elflow.util.errors import ELFError

# what a command may ask of a model besides texts from noise, with the flag or command that asks it
FEATURES = {
    "pairs": "training on (source, target) pairs (--source-length, --task) and sampling from sources (--source)",
    "known": "texts held fixed while sampling (--prompt, --suffix)",
    "trajectory": "the decode readout of each step (--trajectory)",
    "init-from": "starting from another run's weights (--init-from)",
    "distill": "progressive distillation (elflow distill)",
    "grad-checkpoint": "activation checkpointing (--grad-checkpoint)",
    "encoder": "an encoder for the released checkpoints (--encoder)",
    "flow": "the flow objective's constants and the network's variants (--predict, --conditioning, --bottleneck, "
            "--decoder, --noise-scale, --decode-prob, ...)",
}


class Method:
    """The protocol (module docstring) with the parts every method shares."""

    name: str = ""
    title: str = ""  # a model of this method in a sentence: "an ELF model", "a token-level AR baseline"
    features: frozenset = frozenset()  # keys of FEATURES
    knobs: tuple[str, ...] = ()  # the sampling flags its sampler takes, besides --seed and --batch
    sweep_axes: tuple[str, ...] = ()  # the knobs `elflow sweep` varies: curves by all but the last, which runs along
    sweep_fixed: tuple[str, ...] = ()  # the knobs a sweep holds at one value
    # what a training step holds besides the trained pass (elflow.util.budget.check_training reads them)
    teacher = None  # a frozen network whose no-grad passes make the targets (a distillation's teacher)
    tangents: bool = False  # the trained pass also carries forward-mode tangents (a time derivative)
    logits_everywhere: bool = False  # every position of every row is read out over the vocabulary

    def __repr__(self) -> str:
        return f"<method {self.name}>"

    # -- the run ----------------------------------------------------------------------------------------------
    def space_spec(self, spec: dict) -> dict:
        return spec

    def check(self, cfg) -> None:
        """ELFError for the first setting of the run (a TrainConfig) this method cannot train with."""

    def build(self, cfg, shape, space, data, recipe, device) -> tuple[nn.Module, dict]:
        raise NotImplementedError

    # -- the network as a record stores it (elflow.runs.record) ------------------------------------------
    config_type: type = object  # the network config's type
    sampling_type: type = object  # the sampling settings' type

    def network_of(self, net) -> tuple[object, object]:
        """(the network's config, its options: None for a method without any) as a record stores them."""
        return net.config, None

    def build_network(self, record, max_length: int | None = None) -> nn.Module:
        """The (untrained) network a record describes; `max_length` widens its position table."""
        raise NotImplementedError

    derived: tuple[str, ...] = ()  # the network config's fields that follow from the rest of a record

    def derive(self, recipe, distillation) -> dict:
        """The values of the `derived` fields for a model of this recipe and distillation (None: none): a record
        stores none of them, and sets them on its network from its other parts."""
        return {}

    def check_record(self, record) -> None:
        """ELFError for a record whose network, options, recipe and sampling settings do not fit together."""

    def default_sampling(self, record):
        """The sampling settings a model of this record samples with when no flag is given."""
        raise NotImplementedError

    def fits(self, space, net) -> None:
        """ELFError when `space` cannot serve `net`."""

    def adam_names(self, net, cfg) -> list[str]:
        return []

    # -- a training step ----------------------------------------------------------------------------------
    def draw(self, batch: dict, space, recipe, generator: torch.Generator, cpu_generator: torch.Generator):
        """The shard's randomness, drawn outside the trained pass (None: the method draws none there)."""
        return None

    def loss(self, net, space, batch: dict, draw, recipe) -> tuple[torch.Tensor, dict]:
        """The trained pass of one shard, every method's: what the network reads of the batch (`inputs`), the
        method's objective on it (`objective`: the loss and its terms) and the sums of the shard that the log
        reads (`sums`). Returns (loss, sums)."""
        inputs = self.inputs(space, batch, draw)
        loss, terms = self.objective(net, inputs, batch, draw, recipe)
        return loss, self.sums(loss, terms, draw)

    def inputs(self, space, batch: dict, draw):
        """What the network reads of the batch: its token ids (B, L)."""
        return batch["tokens"]

    def objective(self, net, inputs, batch: dict, draw, recipe) -> tuple[torch.Tensor, dict]:
        """(the loss of the batch, its terms: whatever `sums` reads) for the network's `inputs`."""
        raise NotImplementedError

    def sums(self, loss: torch.Tensor, terms: dict, draw) -> dict:
        """Tensors that add up across shards, steps and ranks (no host sync); `summarize` reads their totals."""
        return {"loss": loss.detach()}

    def summarize(self, sums: dict) -> dict:
        return {}

    def preview(self, net, ema, space, num: int, length: int, record, seed: int) -> list[str]:
        """`num` samples of the EMA weights as the run's record says it samples (its `sampling`), drawn from
        one generator seeded by `seed`."""
        raise NotImplementedError

    # -- sampling -----------------------------------------------------------------------------------------
    def check_knobs(self, given: dict) -> None:
        """A one-line error for a sampling flag this method's sampler does not take."""
        for name, value in given.items():
            if value is not None and name not in self.knobs:
                takes = ", ".join("--" + k.replace("_", "-") for k in self.knobs)
                raise ELFError(f"--{name.replace('_', '-')} does not apply to {self.title}; its sampler takes "
                               f"{takes}")

    def sampling_settings(self, record, seed=None, batch_size=None, **given):
        """The settings a model samples with: `record`'s defaults with the flags given on top (None: not
        given); a flag its sampler does not take is a one-line error."""
        raise NotImplementedError

    def generate(self, net, space, num: int, settings, length: int | None = None, progress: bool = True,
                 part: tuple[int, int] = (0, 1), **known) -> list[dict]:
        """Records {"index", "text", ...} of `num` samples; `part` = (rank, ranks): only that rank's batches,
        which together with the other ranks' are the samples of one process (generate.generation_batches)."""
        raise NotImplementedError


class TrainedPass(nn.Module):
    """One method's trained pass as a module (see the module docstring): `draw(batch, generator,
    cpu_generator)` outside the wrappers, `forward(batch, draw) -> (loss, sums)` inside them (`Method.loss`)."""

    def __init__(self, method: Method, net: nn.Module, space: nn.Module, recipe=None):
        super().__init__()
        self.net, self.space = net, space
        self.method, self.recipe = method, recipe

    def draw(self, batch: dict, generator: torch.Generator, cpu_generator: torch.Generator):
        return self.method.draw(batch, self.space, self.recipe, generator, cpu_generator)

    def forward(self, batch: dict, draw):
        return self.method.loss(self.net, self.space, batch, draw, self.recipe)
