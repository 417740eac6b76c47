"""The decoder stage of a --decoder separate run: a network of the run's shape trained in decode mode alone,
into OUT/decoder, and then frozen as the decoder of the denoiser's stage (elflow.train runs both)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from elflow.config import TrainConfig
from elflow.runs.folder import (
    DECODER_STAGE,  # the first stage's run folder, inside the run's own
    RUN_FILE,
)
from elflow.runs.load import check_init_compatible, load_init_weights


def in_first_stage(out: Path) -> bool:
    """Whether `out` holds a --decoder separate run that has not yet started its second stage."""
    return not (out / RUN_FILE).exists() and (out / DECODER_STAGE / RUN_FILE).exists()


def attach_decoder(net, path, space) -> None:
    """A separate decoder's weights into `net` (a SeparateDecoderELF): the EMA weights of the decode-only run
    `path`, which must hold a network of the decoder's shape and options in the same space."""

    record, sd, _ = load_init_weights(path)
    check_init_compatible(path, record, net.decoder, space)
    net.load_decoder(sd)


def decoder_stage(cfg: TrainConfig) -> TrainConfig:
    """The first stage of a --decoder separate run: the network of its shape trained in decode mode alone
    (decode_prob 1) for --decoder-steps (a quarter of --steps by default), warmed up over the same share of
    its steps; it becomes the frozen decoder of the second stage."""
    steps = cfg.decoder_steps or max(1, math.ceil(cfg.steps / 4))
    return replace(cfg, network=cfg.network.replace(decoder="shared"), decoder_steps=None, decoder_from=None,
                   steps=steps, epochs=None,
                   warmup=math.ceil(cfg.warmup * steps / cfg.steps) if cfg.warmup_frac is None else cfg.warmup,
                   recipe=cfg.flow_recipe().replace(decode_prob=1.0), sample_every=0)
