"""The training methods by name, and a small trainer for the token-level baselines.

    METHOD_NAMES                      ("elf", "ar", "mdlm")
    get_method(name)                  the baseline's module (elflow.ar or elflow.mdlm), None for "elf" (which
                                      elflow.train runs); an unknown name is a one-line ELFError
    fit_shape(name, elf_config, space, match)   the baseline's shape with about an ELF network's parameter count
    table_names(model)                the token tables' parameter names (Adam's, not Muon's)
    make_optimizer(model, lr)         ELF's optimiser for a TokenTransformer: Muon on the blocks' matrices, Adam
                                      on norms, biases and the token tables (as ELF's heads under adam_heads)
    BaselineSampling                  a baseline's sampler settings with the seed and batch size (sample, eval,
                                      sweep); sampling_settings(name, ...) builds and checks them
    train_baseline(name, model, batches, steps, ...)   optimiser steps on data.Batches, with an EMA
    heldout_loss(name, model, dataset, ...)            token-weighted held-out loss (AR: NLL, MDLM: NELBO)
    sample_texts(name, model, space, num, length, settings, seed)   decoded samples

Every baseline module exposes the same interface (described in elflow.ar): build(config, space),
loss(model, tokens, mask, generator), sample_tokens(model, batch, length, settings, generator), SETTINGS and
fit_config(target, space, base).
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from elflow import ar, mdlm
from elflow.model import ELF, TokenLMConfig, num_params
from elflow.optim import EMA, ELFOptimizer, lr_at
from elflow.utils import ELFError

__all__ = ["METHOD_NAMES", "BASELINES", "MATCHES", "get_method", "fit_shape", "table_names", "make_optimizer",
           "trunk_params", "train_baseline", "heldout_loss", "sample_texts", "sample_records", "step_seed",
           "BaselineSampling", "sampling_settings"]

BASELINES = {"ar": ar, "mdlm": mdlm}
METHOD_NAMES = ("elf", *BASELINES)


def get_method(name: str):
    """The module of a baseline method; None for "elf"."""
    if name not in METHOD_NAMES:
        raise ELFError(f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}")
    return BASELINES.get(name)


def _baseline(name: str):
    module = get_method(name)
    if module is None:
        raise ELFError(f"method {name!r} is not a token-level baseline; ELF trains through elflow.train")
    return module


MATCHES = ("total", "trunk")


def fit_shape(name: str, elf_config, space, match: str = "total", tie: bool = True, tol: float = 0.05):
    """(baseline shape, target count): the TokenLMConfig of method `name` whose parameter count is within `tol`
    of the ELF network of `elf_config` (an ELFConfig): in all (`match="total"`), or without the token tables
    and ELF's decode head (`"trunk"`). The search starts from ELF's depth, width and heads; `tie` reads out
    with the input table (one token table, as ELF has one read-out table)."""
    module = _baseline(name)
    if match not in MATCHES:
        raise ELFError(f"unknown parameter match {match!r}; choose one of {', '.join(MATCHES)}")
    with torch.device("meta"):
        elf = ELF(elf_config)
        target = elf.num_params() if match == "total" else elf.num_params(exclude_decode_head=True)
    base = TokenLMConfig(depth=elf_config.depth, hidden=elf_config.hidden, heads=elf_config.heads,
                         vocab_size=space.vocab_size, max_length=elf_config.max_length, tie_embeddings=tie)
    try:
        return module.fit_config(target, space, base, tol=tol, tables=match == "total"), target
    except ValueError as e:
        raise ELFError(f"{name}: cannot match the ELF network's {target:,} parameters: {e}") from None


def table_names(model) -> list[str]:
    """The parameter names of a TokenTransformer's token tables (the input table and an untied read-out)."""
    return ["embed.weight"] + (["lm_head.weight"] if model.lm_head is not None else [])


def trunk_params(model) -> int:
    """A TokenTransformer's parameters without its token tables."""
    return num_params(model) - sum(num_params(m) for m in (model.embed, model.lm_head) if m is not None)


def step_seed(seed: int, step: int) -> int:
    """A generator seed for one step of one run, independent of everything else."""
    return int.from_bytes(hashlib.sha256(f"elflow-baseline:{seed}:{step}".encode()).digest()[:8], "little") >> 1


def make_optimizer(model, lr: float, muon_tables: bool = False, ns_method: str = "auto") -> ELFOptimizer:
    """ELFOptimizer over a TokenTransformer. The token tables (input embedding, untied read-out) go to Adam
    unless `muon_tables`, as ELF's output heads and embedders do with adam_heads."""
    return ELFOptimizer(model.named_parameters(), lr=lr, adam=() if muon_tables else table_names(model),
                        ns_method=ns_method)


def _autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if dtype != "fp32":
        raise ELFError(f"dtype must be fp32 or bf16, got {dtype!r}")
    return nullcontext()


def train_baseline(name: str, model, batches, steps: int, lr: float = 1e-3, warmup: int = 0,
                   ema_decay: float = 0.99, seed: int = 0, grad_clip: float = 1.0, muon_tables: bool = False,
                   dtype: str = "fp32", optimizer: ELFOptimizer | None = None, ema: EMA | None = None,
                   start: int = 0, callback=None) -> dict:
    """`steps` optimiser steps of a baseline on batches from `batches` (a data.Batches or any iterator of
    {"tokens", "mask"} dicts), ELF's learning-rate schedule (linear warm-up, then constant). Each step's
    randomness comes from a generator seeded by (seed, step). `callback(step, metrics)` sees every step.
    Returns {"optimizer", "ema", "losses", "tokens_seen"}; pass optimizer, ema and start back to continue."""
    method = _baseline(name)
    device = model.embed.weight.device
    optimizer = optimizer or make_optimizer(model, lr, muon_tables)
    ema = ema or EMA(model, ema_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    losses, seen = [], 0
    model.train()
    for step in range(start, start + steps):
        batch = next(batches)
        tokens = batch["tokens"].to(device)
        mask = batch.get("mask")
        mask = mask.to(device) if mask is not None else None
        g = torch.Generator(device=device).manual_seed(step_seed(seed, step))
        with _autocast(device, dtype):
            loss, metrics = method.loss(model, tokens, mask, g)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        if not torch.isfinite(grad_norm) or not torch.isfinite(loss):
            raise ELFError(f"{name}: non-finite loss or gradient at step {step}; try a lower lr or fp32")
        optimizer.set_lr(lr_at(step, lr, warmup))
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
        losses.append(float(loss.detach()))
        seen += tokens.numel()
        if callback is not None:
            callback(step, metrics)
    return {"optimizer": optimizer, "ema": ema, "losses": losses, "tokens_seen": seen}


@torch.no_grad()
def heldout_loss(name: str, model, dataset, batch: int = 32, rows: int = 256, seed: int = 0) -> float:
    """Sum of the loss terms over the scored positions of the first `rows` rows, per scored position: the
    AR NLL, or the MDLM NELBO (its times and masks drawn from `seed`, so two models see the same ones)."""
    method = _baseline(name)
    device = model.embed.weight.device
    was_training = model.training
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    total = count = 0.0
    n = min(rows, len(dataset))
    for i in range(0, n, batch):
        b = dataset.batch(torch.arange(i, min(i + batch, n)))
        _, metrics = method.loss(model, b["tokens"].to(device), b["mask"].to(device), g)
        total += float(metrics["nll_sum"])
        count += float(metrics["tokens"])
    model.train(was_training)
    return total / max(count, 1.0)


@torch.no_grad()
def sample_texts(name: str, model, space, num: int, length: int, settings=None, seed: int = 0,
                 batch_size: int = 16) -> list[str]:
    """`num` samples decoded by the space's tokenizer (cut at the first EOS), drawn in batches from one
    generator seeded by `seed`."""
    method = _baseline(name)
    settings = settings if settings is not None else method.SETTINGS()
    device = model.embed.weight.device
    was_training = model.training
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    texts = []
    for i in range(0, num, batch_size):
        ids = method.sample_tokens(model, min(batch_size, num - i), length, settings, g)
        texts += space.decode(ids.cpu())
    model.train(was_training)
    return texts


# ----------------------------------------------------------------------------------------------------------
# sampler settings as `elflow sample`, `eval` and `sweep` take them


@dataclass(frozen=True)
class BaselineSampling:
    """How to sample a baseline: AR takes temperature and top_p, MDLM steps and temperature; seed and
    batch_size as for ELF (one generator per call, seeded by `seed`)."""

    method: str
    steps: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    seed: int = 0
    batch_size: int = 16

    def check(self) -> "BaselineSampling":
        self.settings()
        if self.batch_size < 1:
            raise ELFError(f"the batch size must be >= 1, got {self.batch_size}")
        return self

    def settings(self):
        """The method's own settings object (ar.ARSampling or mdlm.MDLMSampling)."""
        if self.method == "ar":
            return ar.ARSampling(temperature=self.temperature, top_p=1.0 if self.top_p is None else self.top_p)
        return mdlm.MDLMSampling(steps=self.steps, temperature=self.temperature)

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None}

    def describe(self) -> str:
        if self.method == "ar":
            return f"AR, temperature {self.temperature:g}, top-p {1.0 if self.top_p is None else self.top_p:g}"
        return f"MDLM, {self.steps} steps, temperature {self.temperature:g}"

    def tag(self) -> str:
        if self.method == "ar":
            return f"ar_temperature{self.temperature:g}_topp{1.0 if self.top_p is None else self.top_p:g}"
        return f"mdlm_steps{self.steps}_temperature{self.temperature:g}"


def sampling_settings(name: str, steps: int | None = None, temperature: float | None = None,
                      top_p: float | None = None, seed: int | None = None,
                      batch_size: int | None = None) -> BaselineSampling:
    """A baseline's sampler settings from the values given (None = not given); a value its sampler does not
    take is a one-line error naming the ones it does."""
    _baseline(name)
    if name == "ar" and steps is not None:
        raise ELFError("--steps does not apply to an AR model (it samples one position per step); "
                       "its sampler takes --temperature and --top-p")
    if name == "mdlm" and top_p is not None:
        raise ELFError("--top-p does not apply to an MDLM model; its sampler takes --steps and --temperature")
    d = BaselineSampling(name)
    return BaselineSampling(name, steps=(steps or mdlm.MDLMSampling().steps) if name == "mdlm" else None,
                            temperature=d.temperature if temperature is None else temperature,
                            top_p=(1.0 if top_p is None else top_p) if name == "ar" else None,
                            seed=d.seed if seed is None else seed,
                            batch_size=d.batch_size if batch_size is None else batch_size).check()


@torch.no_grad()
def sample_records(name: str, model, space, num: int, settings: BaselineSampling, length: int) -> list[dict]:
    """`num` samples as records {"index", "text"} (the format of generate.generate)."""
    if num < 1:
        raise ELFError(f"the number of samples must be >= 1, got {num}")
    texts = sample_texts(name, model, space, num, length, settings.settings(), settings.seed, settings.batch_size)
    return [{"index": i, "text": t} for i, t in enumerate(texts)]
