"""The token-level baselines' shared part: their sampler settings, the method around a TokenTransformer sized to
the ELF network of the same flags, and the float64 categorical draw of their samplers."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch

from elflow.generate import generation_batches
from elflow.methods.base import Method
from elflow.methods.token_net import TokenLMConfig
from elflow.model import ELF, num_params
from elflow.space import tokenizer_spec
from elflow.util.errors import ELFError

MATCHES = ("total", "trunk")


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


# the token samplers' own knobs: (check, what the value must be)
KNOB_RANGES = {"temperature": (lambda v: _positive(v) and v <= 100, "a number in (0, 100]"),
               "top_p": (lambda v: _positive(v) and v <= 1, "a number in (0, 1]")}


def table_names(model) -> list[str]:
    """The parameter names of a TokenTransformer's token tables (the input table and an untied read-out)."""
    return ["embed.weight"] + (["lm_head.weight"] if model.lm_head is not None else [])


def trunk_params(model) -> int:
    """A TokenTransformer's parameters without its token tables."""
    return num_params(model) - sum(num_params(m) for m in (model.embed, model.lm_head) if m is not None)


_KIND_WORDS = {str: "a name", int: "a whole number", float: "a finite number"}
BATCH = 16  # samples per batch where the caller gives none


@dataclass(frozen=True)
class BaselineSampling:
    """How to sample a baseline: AR takes temperature and top_p, MDLM steps and temperature; seed and
    batch_size as for ELF (one generator per call, seeded by `seed`), the caller's: a record's generation
    defaults hold neither (None)."""

    method: str
    steps: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    batch_size: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def for_call(self, seed=None, batch_size=None) -> "BaselineSampling":
        """These settings with a call's seed and batch size: those given, else its own, else 0 and BATCH."""
        seed = self.seed if seed is None else seed
        batch_size = self.batch_size if batch_size is None else batch_size
        return replace(self, seed=0 if seed is None else seed, batch_size=BATCH if batch_size is None else batch_size)

    @classmethod
    def from_dict(cls, d: dict) -> "BaselineSampling":
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"BaselineSampling: unknown fields {unknown}")
        for key, kind, optional in (("method", str, False), ("steps", int, True), ("temperature", float, False),
                                    ("top_p", float, True), ("seed", int, True), ("batch_size", int, True)):
            v = d.get(key)
            if v is None and (optional or key not in d):
                continue
            numeric = kind is not str and not isinstance(v, bool) and isinstance(v, (int, float))
            if kind is str and not isinstance(v, str) or kind is not str and not numeric or \
                    kind is int and not isinstance(v, int) or kind is float and not math.isfinite(v):
                raise ValueError(f"BaselineSampling: {key} must be {_KIND_WORDS[kind]}, got {v!r}")
        return cls(**d)

    def replace(self, **kw) -> "BaselineSampling":
        return replace(self, **kw)

    def _knobs(self):
        return [(k, v) for k, v in (("steps", self.steps), ("temperature", self.temperature),
                                    ("top_p", self.top_p)) if v is not None]

    def describe(self) -> str:
        words = {"steps": "{} steps", "temperature": "temperature {:g}", "top_p": "top-p {:g}"}
        return ", ".join([self.method.upper()] + [words[k].format(v) for k, v in self._knobs()])

    def tag(self) -> str:
        """A file-name tag of the settings that tell sample sets apart."""
        return self.method + "".join(f"_{k.replace('_', '')}{v:g}" for k, v in self._knobs())


class TokenMethod(Method):
    """A token-level baseline; subclasses name the module functions (module docstring)."""

    features = frozenset()
    defaults: dict = {}  # the sampler's knobs and their default values
    logits_everywhere = True

    def space_spec(self, spec: dict) -> dict:
        return tokenizer_spec(spec)

    # -- the module's functions -----------------------------------------------------------------------
    def network(self, config: TokenLMConfig, space):
        raise NotImplementedError

    def fit_config(self, target: int, space, base: TokenLMConfig, **kw) -> TokenLMConfig:
        raise NotImplementedError

    def token_draw(self, tokens: torch.Tensor, generator):
        return None

    def generate_tokens(self, model, batch: int, length: int, settings, generator) -> torch.Tensor:
        raise NotImplementedError

    def sampler_settings(self, s: BaselineSampling):
        """The method's own sampling settings (ARSampling, MDLMSampling) from BaselineSampling."""
        raise NotImplementedError

    # -- the run ----------------------------------------------------------------------------------------------
    def fit_shape(self, elf_config, space, match: str = "total", tie: bool = True, tol: float = 0.05):
        return fit_shape(self, elf_config, space, match, tie, tol)

    def build(self, cfg, shape, space, data, recipe, device):
        config, target = self.fit_shape(shape, space, cfg.match)
        torch.manual_seed(cfg.seed)
        net = self.network(config, space).to(device)
        return net, {"model": num_params(net), "elf": target, "match": cfg.match}

    config_type = TokenLMConfig
    sampling_type = BaselineSampling

    def build_network(self, record, max_length=None):
        config = record.network.widened(max_length)
        return self.network(config, _Vocabulary(config.vocab_size))

    def check_record(self, record) -> None:
        if record.sampling.method != self.name:
            raise ELFError(f"sampling settings of {record.sampling.method!r}, not of {self.name!r}")
        kept = [k for k in ("seed", "batch_size") if getattr(record.sampling, k) is not None]
        if kept:
            raise ELFError(f"a model's generation defaults hold no {kept[0]} (the caller's), got "
                           f"{getattr(record.sampling, kept[0])!r}")
        self.sampler_settings(record.sampling)
        if record.task is not None or record.options.active:
            raise ELFError(f"a {self.name} model has no conditional task and no short-run options")

    def default_sampling(self, record) -> BaselineSampling:
        return BaselineSampling(self.name, **self.defaults)

    def fits(self, space, net) -> None:
        if space.vocab_size != net.config.vocab_size:
            raise ELFError(f"the tokenizer ({space.space_id}: vocabulary {space.vocab_size}) does not fit the "
                           f"{self.name} network (vocabulary {net.config.vocab_size})")

    def adam_names(self, net, cfg) -> list[str]:
        """The token tables (an embedding lookup, no matrix map); Muon takes the blocks' matrices."""
        return table_names(net)

    # -- a training step ----------------------------------------------------------------------------------
    def draw(self, batch, space, recipe, generator, cpu_generator):
        return self.token_draw(batch["tokens"], generator)

    def sums(self, loss, terms, draw):
        return {"loss": loss.detach(), "nll_sum": terms["nll_sum"].float(), "nll_n": terms["tokens"].float()}

    def summarize(self, t: dict) -> dict:
        """The loss terms per scored position over the logged steps."""
        return {"loss_per_token": t["nll_sum"] / t["nll_n"] if t["nll_n"] else None}

    @torch.no_grad()
    def preview(self, net, ema, space, num, length, record, seed) -> list[str]:
        sampler_net = self.network(net.config, space).to(next(net.parameters()).device)
        ema.copy_to(sampler_net)
        return self.texts(sampler_net, space, num, length, record.sampling, seed)

    # -- sampling -----------------------------------------------------------------------------------------
    def sampling_settings(self, record=None, seed=None, batch_size=None, **given) -> BaselineSampling:
        self.check_knobs(given)
        stored = record.sampling if record is not None else self.default_sampling(None)
        values = {k: getattr(stored, k) if given.get(k) is None else given[k] for k in self.defaults}
        s = BaselineSampling(self.name, **values).for_call(seed, batch_size)
        self.sampler_settings(s)  # checks the values
        if isinstance(s.batch_size, bool) or not isinstance(s.batch_size, int) or s.batch_size < 1:
            raise ELFError(f"the batch size must be an integer >= 1, got {s.batch_size!r}")
        return s

    @torch.no_grad()
    def records(self, model, space, num: int, length: int, settings: BaselineSampling, seed: int,
                batch_size: int = 16, part: tuple[int, int] = (0, 1)) -> list[dict]:
        """Records {"index", "text"} of `num` samples decoded by the space's tokenizer (cut at the first EOS),
        batch b drawn from a generator seeded by (seed, b); `part` = (rank, ranks): that rank's batches
        (generate.generation_batches)."""
        device = model.embed.weight.device
        was_training = model.training
        model.eval()
        own = self.sampler_settings(settings)
        out = []
        for _, start, rows, batch_seed in generation_batches(num, batch_size, seed, part):
            g = torch.Generator(device=device).manual_seed(batch_seed)
            texts = space.decode(self.generate_tokens(model, rows, length, own, g).cpu())
            out += [{"index": start + j, "text": t} for j, t in enumerate(texts)]
        model.train(was_training)
        return out

    def texts(self, model, space, num: int, length: int, settings: BaselineSampling, seed: int,
              batch_size: int = 16) -> list[str]:
        """The texts of `records` of one process."""
        return [r["text"] for r in self.records(model, space, num, length, settings, seed, batch_size)]

    def generate(self, net, space, num, settings, length=None, progress=True, part=(0, 1), **known) -> list[dict]:
        """`num` samples as records {"index", "text"} (the format of generate.generate); `part`: one rank's."""
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise ELFError(f"the number of samples must be an integer >= 1, got {num!r}")
        settings = settings.for_call()
        return self.records(net, space, num, length or net.config.max_length, settings, settings.seed,
                            settings.batch_size, part)


@dataclass(frozen=True)
class _Vocabulary:
    """What a baseline's builder reads of a space: its vocabulary size."""

    vocab_size: int


def fit_shape(method: TokenMethod, elf_config, space, match: str = "total", tie: bool = True, tol: float = 0.05):
    """(baseline shape, target count): the TokenLMConfig of `method` whose parameter count is within `tol` of
    the ELF network of `elf_config` (an ELFConfig): in all (`match="total"`), or without the token tables and
    ELF's decode head (`"trunk"`). The search starts from ELF's depth, width and heads; `tie` reads out with
    the input table (one token table, as ELF has one read-out table)."""
    if match not in MATCHES:
        raise ELFError(f"unknown parameter match {match!r}; choose one of {', '.join(MATCHES)}")
    with torch.device("meta"):
        elf = ELF(elf_config)
        target = elf.num_params() if match == "total" else elf.num_params(exclude_decode_head=True)
    base = TokenLMConfig(depth=elf_config.depth, hidden=elf_config.hidden, heads=elf_config.heads,
                         vocab_size=space.vocab_size, max_length=elf_config.max_length, tie_embeddings=tie)
    try:
        return method.fit_config(target, space, base, tol=tol, tables=match == "total"), target
    except ValueError as e:
        raise ELFError(f"{method.name}: cannot match the ELF network's {target:,} parameters: {e}") from None


def draw_categorical(weights, generator=None):
    """One draw per row of `weights` (..., V): non-negative, not necessarily normalised. Returns (...) ids.

    Inverse CDF in float64: u ~ U[0, 1) scaled by the row's total, the first index whose cumulative weight
    exceeds it. A zero-weight id is never drawn. Float64 matters: the float32 Gumbel-max trick
    (argmax of log p + Gumbel noise, with u in float32) truncates the Gumbel tail, so low-probability ids are
    drawn too rarely: samples lose entropy and their generative perplexity looks better than the model's.
    """
    import torch

    cdf = weights.to(torch.float64).cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), dtype=torch.float64, generator=generator, device=cdf.device)
    total = cdf[..., -1:].contiguous()
    ids = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the last id of positive weight (u * total may round up)
    return torch.minimum(ids, last).squeeze(-1)
