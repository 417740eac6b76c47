"""The training config: `TrainConfig` (a run's settings as given: what the model is, which its record holds
once it is made, and how it trains, which run.json stores beside the record), the named configs of `--defaults`
(RUN_DEFAULTS) and what --resume may change. Words: a "preset" is a network size (elflow.model.PRESETS,
--preset); "defaults" a named training config (--defaults).
elflow.cli.train_flags makes `elflow train`'s flags from its fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from elflow.data.layout import LAYOUTS, PACKED
from elflow.data.tasks import PAIR_TASKS
from elflow.declare import EPOCHS, LENGTH, MINUTES, ROWS, STEPS, NestedFlag, nested_flag, setting
from elflow.flow import RECIPE_RANGES, SAMPLING_DEFAULTS, Recipe, recipe_for
from elflow.methods import METHOD_NAMES, check_run, get_method
from elflow.methods.baseline import MATCHES
from elflow.model import (
    PRESETS,
    ELFConfig,
    ShortRunOptions,
    options_of,
)
from elflow.newton_schulz import NS_METHODS
from elflow.runs.record import Distillation, ParamCounts, RunRecord, SamplingDefaults, Task
from elflow.schedule import (
    ADAMW_BLR,
    EMA_DECAY,
    LR_DECAYS,
    LR_SCHEDULES,
    MUON_BLR,
    OPTIMIZERS,
    UPDATE_RULE_HELP,
    UPDATE_RULES,
    base_lr,
)
from elflow.space import (
    DRAWN_TABLE_KINDS,
    FIXED_TABLE_KINDS,
    TABLE_STREAM,
    SpaceSpec,
    drawn_table,
    fixed_vectors,
    latent_std_of,
    parse_space,
    space_name,
)
from elflow.util.devices import RUN_DTYPES, resolve_dtype
from elflow.util.distributed import DIST_TIMEOUT_MINUTES
from elflow.util.errors import AT_LEAST_0, AT_LEAST_1, KINDS, POSITIVE, SEED, UNIT, ELFError, Record, check_value

# the run defaults that follow from the network's size (--preset), where a size has its own: tiny is a 32-dim
# random table over the MiniLM tokenizer (no encoder to run), so that it is cheap end to end; the small sizes
# average their weights over a shorter window. The paper's sizes take the paper's (PAPER_SIZE_DEFAULTS).
SIZE_DEFAULTS = {
    "tiny": {"space": "random-table:minilm", "space_dim": 32, "ema_decay": 0.995},
    "demo": {"space": "minilm", "space_dim": None, "ema_decay": 0.995},
}
PAPER_SIZE_DEFAULTS = {"space": "t5-small", "space_dim": None, "ema_decay": EMA_DECAY}


def size_default(preset: str, key: str):
    return SIZE_DEFAULTS.get(preset, PAPER_SIZE_DEFAULTS)[key]


@dataclass(frozen=True)
class NetworkOverrides(Record):
    """The network a run asks for, unresolved: each field an ELFConfig field, None for the preset's (--depth,
    --hidden, --heads, --bottleneck, --predict, --conditioning, --decoder; a distillation student's copy of its
    teacher's shape). What the rest of the run fixes is not among them: `dim`, `vocab_size` and `max_length`
    come from the space and the length, and self-conditioning, the path's constants and the target time from
    the recipe and the distillation (elflow.config.TrainConfig.network_fields)."""

    depth: int | None = None
    hidden: int | None = None
    heads: int | None = None
    bottleneck: int | None = None
    mlp_ratio: float | None = None
    time_tokens: int | None = None
    omega_tokens: int | None = None
    mode_tokens: int | None = None
    rope_theta: float | None = None
    predict: str | None = None
    conditioning: str | None = None
    decoder: str | None = None

    @classmethod
    def of(cls, config: "ELFConfig") -> "NetworkOverrides":
        """A built network's config as the settings that ask for it, every field given."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def given(self) -> dict:
        """The settings given (not None), as ELFConfig fields."""
        return {k: v for k, v in self.to_dict().items() if v is not None}


NetworkOverrides.DECLARED = {f.name: ELFConfig.DECLARED[f.name] for f in fields(NetworkOverrides)}  # ELFConfig's own


def default_space(preset: str) -> dict:
    """The fields of a size's default space (SIZE_DEFAULTS)."""
    dim = size_default(preset, "space_dim")
    return {**parse_space(size_default(preset, "space")), **({"dim": dim} if dim is not None else {})}


def _preset_help(key: str) -> str:
    """A network setting's default by size, in words, from model.PRESETS: the value most sizes take, and the
    sizes that take another."""
    values = {name: getattr(c, key) for name, c in PRESETS.items()}
    common = max(set(values.values()), key=list(values.values()).count)
    own = [f"{v} for {name}" for name, v in values.items() if v != common]
    return "the preset's: " + ", ".join(own + [f"{common} otherwise"])


def _kind_help(key: str) -> str:
    """A sampling default by kind of model, in words, from SAMPLING_DEFAULTS."""
    text, cond = (SAMPLING_DEFAULTS[kind][key] for kind in ("text", "conditional"))
    return f"its kind's: {text:g} for text, {cond:g} for a conditional model" if key != "sampler" else \
        f"its kind's: {text} for text, {cond} for a conditional model"


def _size_help(key: str, show=str) -> str:
    """A setting's default by size, in words, from SIZE_DEFAULTS."""
    own = [f"{show(v[key])} for {name}" for name, v in SIZE_DEFAULTS.items() if v[key] is not None]
    return ", ".join(own) + f", {show(PAPER_SIZE_DEFAULTS[key])} otherwise"


# what a run's record holds of its settings, declared with each field (`setting(held=...)`): "record", held by
# every record (its method and how a baseline was sized, its length and task, its flow recipe, its distillation
# and its sampling defaults); "elf", held by an ELF network's record (a baseline's record holds its own network
# and its tokenizer, not the ELF network and space it is sized against, which stay with its training settings)
def held_settings(method: str) -> tuple[str, ...]:
    """The settings the record of a model of `method` holds."""
    held = ("record", "elf") if get_method(method).config_type is ELFConfig else ("record",)
    return tuple(f.name for f in fields(TrainConfig) if f.metadata.get("held") in held)


def record_settings(record: RunRecord) -> dict:
    """The settings `record` holds (`held_settings`), as TrainConfig names and stores them: a run's settings
    are these and the ones stored beside its record. The network settings are the network's own fields (the
    preset's and the ones given alike); the sampling defaults those of the record's sampling that a run may set
    (SamplingDefaults); the space the record's, without its id (the built space's, which a run checks its own
    against)."""
    sampling = record.sampling.to_dict()
    out = {"method": record.method, "match": record.params.match if record.params else ParamCounts.match,
           "length": record.length, "task": record.task.to_dict() if record.task else None,
           "recipe": record.recipe.to_dict(),
           "distillation": record.distillation.to_dict() if record.distillation else None,
           "sampling": {f.name: sampling.get(f.name) for f in fields(SamplingDefaults)}}
    if isinstance(record.network, ELFConfig):
        out.update(network=NetworkOverrides.of(record.network).to_dict(), short_run=record.options.to_dict(),
                   space=asdict(replace(record.space, id=None)))
    return out


@dataclass
class TrainConfig(Record):
    """Everything a run is given (its flags): the settings that describe the model, which its record holds once
    it is made (`record_settings`), and how it trains, which run.json stores beside the
    record (`beside`; `of_run` reads the two back into one TrainConfig).

    `None` means "the preset's default" and is filled in by `resolved()`."""

    method: str = setting("elf", "what to train: ELF, or a token-level baseline over the same space's tokens: an "
                                 "autoregressive LM (ar) or a masked diffusion LM (mdlm)", choices=METHOD_NAMES,
                          held="record")
    preset: str = setting("demo", "the network's size, a name of elflow.model.PRESETS (a baseline: the parameter "
                                  "count of this ELF network); --defaults is a named set of run settings",
                          choices=tuple(PRESETS))
    match: str = setting("total", "baselines: match the ELF network's parameter count in all, or without the "
                                  "token tables and ELF's decode head (trunk)", choices=MATCHES, held="record")
    decoder_steps: int | None = setting(None, "--decoder separate: optimiser steps of the decoder's stage, trained "
                                              "into OUT/decoder before the denoiser's --steps",
                                        default_help="a quarter of --steps, so the decoder sees a quarter of the "
                                                     "denoiser's rows, as the decode branch does", check=AT_LEAST_1)
    decoder_from: str | None = setting(None, "--decoder separate: take the decoder from this run instead of training "
                                             "it (a decode-only run: elflow train --decode-prob 1, same shape and "
                                             "space)", flag="--decoder-from", path=True)
    optimizer: str = setting("muon", "Muon on matrices with Adam on the rest (the paper's), or AdamW on every "
                                     "parameter", choices=OPTIMIZERS)
    weight_decay: float = setting(0.0, "decoupled weight decay of the optimiser (0 in the paper's recipe)",
                                  check=AT_LEAST_0)
    data: str = setting("builtin", "a token store made by `elflow prepare`, or 'builtin' (Shakespeare), a .txt "
                                   "file or folder, a .jsonl file or a hub dataset name (prepared once into a "
                                   "store in the cache)", path=True)
    text_field: str = setting("text", "the text field of .jsonl / hub records", flag="--field")
    on_bad: str = setting("stop", "empty, binary or non-UTF-8 files and bad jsonl lines: stop with an error, or "
                                  "skip them with a warning", choices=("stop", "skip"))
    length: int | None = setting(None, "sequence length L", default_help="the preset's", check=LENGTH, held="record")
    layout: str = setting(PACKED, "packed: documents run on across rows; document: one document per row",
                          choices=LAYOUTS)
    batch: int = setting(32, "global batch: rows per optimiser step over all ranks", check=ROWS)
    micro_batch: int | None = setting(None, "rows per forward/backward; batch / (ranks x micro-batch) "
                                            "accumulation steps. Stored with the run: a resume on another number "
                                            "of ranks keeps it and changes the accumulation, so that the run "
                                            "continues exactly; giving another one on --resume continues with "
                                            "other noise", default_help="batch / ranks at the run's start",
                                      check=ROWS, mutable=True)
    steps: int = setting(1000, "optimiser steps (the schedule's length)", check=STEPS, mutable=True)
    lr: float | None = setting(None, "learning rate", default_help=f"{MUON_BLR:g} x batch / 256; AdamW {ADAMW_BLR:g} x batch / 256",
                               check=POSITIVE)
    warmup: int = setting(100, "linear warm-up steps", check=AT_LEAST_0)
    lr_decay: str = setting("constant", "after the warm-up: constant (the paper's) or a cosine decay to 0 at "
                                        "step --steps, one past the run's last (short runs)", choices=LR_DECAYS)
    lr_schedule: str = setting("released", "where the warm-up starts: released (step k from 0 at lr k / W, as the "
                                           "authors' code; the first step only fills the optimiser's moments) or "
                                           "one-ahead (lr (k + 1) / W: the schedule of earlier elflow runs, which "
                                           "keep it when resumed)", choices=LR_SCHEDULES, cli=False, kept=True)
    ema_decay: float | None = setting(None, "EMA decay of the weights used for sampling",
                                      default_help=_size_help("ema_decay"), check=UNIT)
    adam_heads: bool = setting(False, "optimise output heads and embedders with Adam instead of Muon "
                                      "(cheaper on CPU)")
    ns_method: str = setting("auto", "how Muon's Newton-Schulz polynomial is evaluated: iterate (torch's five "
                                     "steps), spectral (on the Gram matrix's eigenvalues, faster on a CPU for "
                                     "large matrices), by-shape (spectral where it pays); auto: by-shape for fp32 "
                                     "Newton-Schulz on CPUs, iterate on GPUs", choices=NS_METHODS)
    update_rule: str = setting("released", "how Muon and Adam step the weights: " + "; ".join(
        f"{k}: {v}" for k, v in UPDATE_RULE_HELP.items()), choices=UPDATE_RULES, kept=True)
    grad_clip: float = setting(1.0, "gradient-norm clipping (0: none)", check=AT_LEAST_0)
    dtype: str = setting("auto", "autocast precision; auto: bf16 on GPUs and CPUs with native bf16 matmuls, "
                                 "else fp32, stored resolved with the run (--print-config shows what it picks on "
                                 "--device)", choices=RUN_DTYPES)
    compile: bool = setting(False, "torch.compile the network")
    tf32: bool = setting(True, "TF32 matmuls for the fp32 work of a step on CUDA GPUs (the input path, the heads, "
                               "the loss); no effect on CPUs")
    dist_timeout: float = setting(DIST_TIMEOUT_MINUTES, "minutes a rank waits for the others under torchrun before "
                                                        "the job fails (covers a data preparation or a download on "
                                                        "one node while the others wait)", check=MINUTES,
                                  mutable=True)
    grad_checkpoint: bool = setting(False, "activation checkpointing per block")
    seed: int = setting(0, "seed of the initialisation, the data order and the noise", check=SEED)
    val_fraction: float = setting(0.02, "share of sequences held out for validation (0: none)", check=UNIT)
    log_every: int = setting(10, "steps per metrics line", check=AT_LEAST_1, mutable=True)
    ckpt_every: int = setting(500, "steps per checkpoint (and one at the end)", check=AT_LEAST_1, mutable=True)
    keep: int = setting(3, "newest checkpoints kept; 0 keeps all of them", check=AT_LEAST_0, mutable=True)
    sample_every: int = setting(0, "print samples of the EMA model every N steps (0: never)", check=AT_LEAST_0,
                                mutable=True)
    tensorboard: bool = setting(False, "also log to TensorBoard (RUN/tb)", mutable=True)
    wandb: str | None = setting(None, "also log to this Weights & Biases project: the metrics records, the run's "
                                      "settings and the samples shown during training (needs `pip install "
                                      "\"elflow[wandb]\"`; WANDB_MODE=offline logs without an account); a resumed "
                                      "run continues its W&B run; --wandb '' turns it off", default_help="none",
                                mutable=True, flag="--wandb")
    wandb_run: str | None = setting(None, "the W&B run's display name", default_help="the run folder's name",
                                    mutable=True)
    epochs: float | None = setting(None, "the run's length in passes over the data (replaces --steps)",
                                   check=EPOCHS)
    warmup_frac: float | None = setting(None, "the warm-up as a fraction of the run (replaces --warmup)", check=UNIT)
    init_from: str | None = setting(None, "start from the weights of this run or checkpoint (its EMA weights; a "
                                    "fresh optimiser, EMA and step 0)", flag="--init-from", path=True)
    recipe: Recipe | None = setting(None, "the flow recipe (elflow.flow.Recipe; the recipe flags set its fields)",
                                    default_help="the released recipe of the run's kind (flow.recipe_for)",
                                    cli=False, held="record")
    network: NetworkOverrides = setting(help="the network, its fields not given the preset's (elflow.config."
                                             "NetworkOverrides; --depth, --hidden, --heads, --bottleneck, --predict, "
                                             "--conditioning and --decoder set its fields; a distillation's "
                                             "students: the teacher's shape)", cli=False,
                                        default_factory=lambda: NetworkOverrides(), held="elf")
    space: SpaceSpec | None = setting(None, "the embedding space (elflow.space.SpaceSpec; --space, --space-dim, "
                                            "--space-seed and --latent-std set its fields)",
                                      default_help="the preset's (SIZE_DEFAULTS)", cli=False, held="elf")
    short_run: ShortRunOptions = setting(help="the network's options for short runs (elflow.model.ShortRunOptions; "
                                              "the short-run flags set its fields)", cli=False,
                                         default_factory=ShortRunOptions, held="elf")
    task: Task | None = setting(None, "a conditional model's layout (elflow.runs.record.Task; --source-length "
                                      "and the pair flags set its fields)", default_help="none: plain text",
                                cli=False, held="record")
    # the model's own sampling defaults (its record's `sampling`, which its previews, `elflow sample` and
    # `elflow eval` use), where given; not given, those of its kind (elflow.generate.default_sampling)
    sampling: SamplingDefaults = setting(help="the model's sampling defaults (elflow.runs.record.SamplingDefaults; "
                                              "--sample-steps, --sample-sampler and --sample-omega set its fields)",
                                         cli=False, mutable=True, default_factory=SamplingDefaults, held="record")
    distillation: Distillation | None = setting(None, "how the students of a distillation are trained "
                                                      "(elflow.runs.record.Distillation; set by elflow distill)",
                                                cli=False, held="record")

    def __post_init__(self):
        """The typed parts may be given as dicts of their fields (a stored run, RUN_DEFAULTS, the recipe and
        short-run flags): each is read into its type here, its fields' ranges checked first (ELFError naming the
        flag)."""
        for key, nested in NESTED_FLAGS.items():
            part = getattr(self, key[0])
            v = part.get(key[1]) if isinstance(part, dict) else None
            if v is not None:
                nested.check_value(v)
        if self.short_run is None:  # the paper's network
            self.short_run = ShortRunOptions()
        if self.sampling is None:  # none given
            self.sampling = SamplingDefaults()
        if isinstance(self.space, str):  # a --space value: the space it names
            self.space = parse_space(self.space)
        # (setting, its type, None allowed, what it is called, how a dict of its fields is read)
        for name, typ, optional, words, read in (
                ("space", SpaceSpec, True, "space", self._space_of),
                ("task", Task, True, "task", _task_of),
                ("sampling", SamplingDefaults, False, "sampling defaults", SamplingDefaults.from_dict),
                ("recipe", Recipe, True, "recipe", lambda d: recipe_for(d, conditional=self.conditional)),
                ("network", NetworkOverrides, False, "network settings", NetworkOverrides.from_dict),
                ("short_run", ShortRunOptions, False, "short-run options", options_of),
                ("distillation", Distillation, True, "distillation", lambda d: Distillation.from_dict(d) if d else None)):
            value = getattr(self, name)
            if isinstance(value, dict):
                try:
                    value = read(value)
                except (ValueError, TypeError) as e:
                    raise ELFError(f"the run's {words} cannot be read: {e}") from None
                setattr(self, name, value)
            if not isinstance(value, typ) and not (optional and value is None):
                raise ELFError(f"the run's {name} must be a JSON object of {typ.__name__} fields, got "
                               f"{type(value).__name__}")

    def _space_of(self, d: dict) -> SpaceSpec:
        """The space of the fields given; a space whose kind is not given is the preset's with those fields."""
        if d.get("kind") is None:
            d = {**default_space(self.preset), **{k: v for k, v in d.items() if v is not None}}
        return SpaceSpec.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict, strict: bool = False) -> "TrainConfig":
        """From a dict of settings (a stored run's: `stored`); missing keys take their defaults; keys it does not
        know are a ValueError naming them when `strict`, else ignored."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if strict and unknown:
            raise ValueError(f"unknown settings {unknown}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def stored(cls, d, where) -> "TrainConfig":
        """A run's whole settings as stored (a first stage's "stage_of", or those `of_run` puts together from a
        run.json of today's layout: elflow.runs.migrate makes an earlier one so): every setting present and
        none unknown, each checked (`validate`); ELFError naming `where` and the setting."""
        if not isinstance(d, dict):
            raise ELFError(f"{where}: its training settings must be a JSON object, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        unknown, missing = sorted(set(d) - set(names)), [n for n in names if n not in d]
        if unknown:
            raise ELFError(f"{where}: its training settings hold unknown settings {unknown}")
        if missing:
            raise ELFError(f"{where}: its training settings lack {', '.join(map(repr, missing[:3]))}; a run.json of "
                           "this version holds every setting (restore the file as elflow wrote it)")
        try:
            cfg = cls(**d)
        except ELFError as e:
            raise ELFError(f"{where}: {e}") from None
        cfg.validate(stored=where)
        return cfg

    @classmethod
    def of_run(cls, record: RunRecord, train, where) -> "TrainConfig":
        """A run's training settings from what its run.json (or model folder) stores: its record, which holds
        the settings that describe the model (`record_settings`), and the settings stored beside it (`beside`),
        each read from the one place it is stored. ELFError naming `where` for settings beside the record that
        restate one it holds, or that are missing, unknown or out of range (`stored`)."""
        if not isinstance(train, dict):
            raise ELFError(f"{where}: its training settings must be a JSON object, got {type(train).__name__}")
        twice = [k for k in held_settings(record.method) if k in train]
        if twice:
            raise ELFError(f"{where}: its training settings hold {', '.join(map(repr, twice[:3]))}, which its "
                           "record holds; a run.json of this version stores each once (restore the file as elflow "
                           "wrote it)")
        return cls.stored({**train, **record_settings(record)}, where)

    def beside(self, record: RunRecord) -> dict:
        """The settings run.json stores beside `record` (the run's, made from these settings): those the record
        does not hold (`held_settings`), as `to_dict` writes them."""
        held = held_settings(record.method)
        return {k: v for k, v in self.to_dict().items() if k not in held}

    @classmethod
    def named(cls, name: str | None, **overrides) -> "TrainConfig":
        """A named training config (RUN_DEFAULTS) with `overrides` on top; None: the plain defaults."""
        if name is None:
            return cls(**overrides)
        if name not in RUN_DEFAULTS:
            raise ELFError(f"unknown --defaults {name!r}; choose one of {', '.join(RUN_DEFAULTS)}")
        base, derived = RUN_DEFAULTS[name]
        values = {k: dict(v) if isinstance(v, dict) else v for k, v in {**base, **overrides}.items()}
        for key, fn in derived.items():
            if key not in overrides:
                values[key] = fn(values)
        return cls(**values)

    def network_fields(self, recipe) -> dict:
        """The ELFConfig fields the run sets besides its preset and its space: those given (`network`), and those
        that follow from the rest of the run as a record derives them (elflow.methods.elf's `derive`: its
        self-conditioning, the path's constants and the target time, from `recipe` and the distillation)."""
        return {**self.network.given(), **get_method("elf").derive(recipe, self.distillation)}

    def flow_recipe(self) -> Recipe:
        """The run's flow recipe: the one given, else the released recipe of its kind (flow.recipe_for)."""
        return self.recipe if self.recipe is not None else recipe_for({}, conditional=self.conditional)

    @property
    def conditional(self) -> bool:
        """Whether the run trains on (source, target) pairs (it has a task)."""
        return self.task is not None

    @property
    def separate_decoder(self) -> bool:
        return self.network.decoder == "separate"

    def resolved(self, device=None) -> "TrainConfig":
        """The same run with every preset-dependent default filled in; with a `device`, `dtype` "auto" becomes
        the precision it picks there."""
        space = self.space or SpaceSpec.from_dict(default_space(self.preset))
        if drawn_table(space):  # a table drawn from the space seed, on the stream of today's draws
            space = replace(space, seed=space.seed or 0, stream=space.stream or TABLE_STREAM)
        preset = PRESETS.get(self.preset)
        dtype = resolve_dtype(self.dtype, device) if device is not None else self.dtype
        return replace(self, space=space, dtype=dtype, recipe=self.flow_recipe(),
                       ema_decay=self.ema_decay if self.ema_decay is not None else size_default(self.preset,
                                                                                                 "ema_decay"),
                       length=self.length if self.length is not None else (preset.max_length if preset else None),
                       lr=self.lr if self.lr is not None else base_lr(self.batch, MUON_BLR if self.optimizer == "muon"
                                                                       else ADAMW_BLR))

    def validate(self, stored=None) -> None:
        """ELFError naming the first setting out of range: as the flag (`--batch`), or, for the settings stored
        in the file `stored` (run.json on --resume), as that file's setting."""
        def name(flag_name: str) -> str:
            return f"--{flag_name.replace('_', '-')}" if stored is None else f"{stored}: its setting {flag_name!r}"

        if not isinstance(self.preset, str) or self.preset not in PRESETS:
            raise ELFError(f"{name('preset')}: unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        for f in fields(self):
            v, meta = getattr(self, f.name), f.metadata
            if v is not None and f.type in KINDS:
                check_value(name(f.name) if stored is not None else flag_of(f), KINDS[f.type], v, meta.get("choices"),
                            meta.get("check"))
        for (part, key), nested in NESTED_FLAGS.items():  # the typed parts' fields, however they were given
            v = getattr(getattr(self, part), key, None)
            if v is not None:
                try:
                    nested.check_value(v)
                except ELFError as e:
                    raise ELFError(f"{stored}: {e}" if stored is not None else str(e)) from None
        try:
            check_run(self)
        except ELFError as e:
            raise ELFError(f"{stored}: {e}" if stored is not None else str(e)) from None
        if self.optimizer == "adamw":
            for attr in ("adam_heads", "ns_method", "update_rule"):
                if getattr(self, attr) != next(f for f in fields(self) if f.name == attr).default:
                    raise ELFError(f"{name(attr)} sets up Muon; it does not apply to --optimizer adamw")
        readout = self.short_run.table_readout
        if self.space is not None:
            if readout > 0 and not fixed_vectors(self.space):
                raise ELFError(f"{name('table_readout')} {readout:g}: the table readout needs a space with one vector "
                               f"per token ({' or '.join(FIXED_TABLE_KINDS)}), and {name('space')} "
                               f"{space_name(self.space)} has none: pass {name('table_readout')} 0, or choose such a "
                               "space")
            if self.space.dim is not None and not drawn_table(self.space):
                dim = NESTED_FLAGS["space", "dim"].flag if stored is None else f"{stored}: its setting 'space.dim'"
                raise ELFError(f"{dim} applies to {' and '.join(DRAWN_TABLE_KINDS)} spaces, not to "
                               f"{space_name(self.space)}")
        if self.task is not None and self.length is not None and self.task.source_length >= self.length:
            source = NESTED_FLAGS["task", "source_length"].flag if stored is None else \
                f"{stored}: its setting 'task.source_length'"
            raise ELFError(f"{source} {self.task.source_length} leaves no room for a target in "
                           f"{name('length')} {self.length}; use a longer length or a shorter source length")


# named training configs (--defaults): (values, values derived from the others unless given)
RUN_DEFAULTS: dict[str, tuple[dict, dict]] = {
    # `elflow quickstart`: the demo network on the built-in corpus for a few minutes on a CPU: a random table
    # over MiniLM's tokenizer, lr 3e-3, EMA 0.95, and the network's options for short runs
    # (elflow.model.ShortRunOptions)
    "quickstart": (
        dict(preset="demo", data="builtin", space=parse_space("random-table:minilm"), length=64, batch=32, steps=250,
             lr=3e-3,
             warmup=50, ema_decay=0.95, adam_heads=True, dtype="auto", log_every=10, keep=2,
             short_run={"skip": "gated", "time_scale": 1000.0, "head_modulation": True, "table_readout": 1.0}),
        dict(ckpt_every=lambda v: max(v["steps"] // 4, 1), sample_every=lambda v: max(v["steps"] // 4, 1)),
    ),
    # the paper's conditional tasks: ELF-B in T5-small's space, warm-up 5,000 (and, as every conditional run,
    # decode corruption 1.0: flow.recipe_for)
    **{name: (dict(preset="elf-b", space=parse_space("t5-small"),
                   task={"name": name, "source_length": t["source_length"]},
                   data=t["data"], length=t["length"], warmup=t["warmup"], layout="document"), {})
       for name, t in PAIR_TASKS.items()},
}


def _task_of(d: dict) -> Task | None:
    """A run's task from the fields its flags give (--source-length, --source-slot, --task, --source-field,
    --target-field); ELFError when a pair flag comes without --source-length."""
    given = {k: v for k, v in d.items() if v is not None}
    if not given:
        return None
    if "source_length" not in given:
        flags = ", ".join(NESTED_FLAGS["task", k].flag for k in given)
        raise ELFError(f"{flags} lay{'s' if len(given) == 1 else ''} out (source, target) pairs; give "
                       f"{NESTED_FLAGS['task', 'source_length'].flag} too (the most tokens a source takes)")
    return Task.from_dict(given)


def part_flag(part: str, name: str, help: str, default_help: str = "the preset's", flag: str | None = None,
              sets=None, typ=None) -> tuple[tuple[str, str], NestedFlag]:
    """The flag that sets the field `name` of the typed part `part` (a TrainConfig field, PART_TYPES): its
    range and choices are those the part's type declares (its DECLARED), its type the field's own unless `typ`
    reads the flag's text; `sets`: a function of the flag's value giving the fields it sets."""
    cls = PART_TYPES[part]
    check, choices = cls.DECLARED.get(name, (None, None))
    if typ is None:
        typ = tuple(choices) if choices else KINDS[next(f.type for f in fields(cls) if f.name == name)]
    return nested_flag(part, name, typ, help, check, default_help, flag, sets)


# the typed parts of TrainConfig that flags set one field of
PART_TYPES = {"network": NetworkOverrides, "space": SpaceSpec, "short_run": ShortRunOptions, "task": Task,
              "sampling": SamplingDefaults}


# flags that set one field of a typed part: (part, field) -> NestedFlag
NESTED_FLAGS: dict[tuple[str, str], NestedFlag] = dict((
    part_flag("network", "depth", "transformer blocks"),
    part_flag("network", "hidden", "hidden width"),
    part_flag("network", "heads", "attention heads"),
    part_flag("network", "bottleneck", "ELF: width of the input bottleneck (32 / 128 / 512 in the paper)",
              _preset_help("bottleneck")),
    part_flag("network", "predict", "ELF: what the denoise head outputs, the clean embeddings x, the velocity v or "
              "the noise eps; the loss is the v-space MSE whatever the target (the output turned into v), and "
              "sampling turns it into x likewise", "x"),
    part_flag("network", "conditioning", "ELF: how t, omega and the mode reach the network: prefix tokens, or DiT's "
              "adaLN-Zero modulation in every block (no prefix)", "tokens"),
    part_flag("network", "decoder", "ELF: who reads out tokens: the denoiser itself in decode mode, or a separate "
              "network trained first on noisy embeddings (then frozen while the denoiser trains; both stored as one "
              "model)", "shared"),
    part_flag("space", "kind", "embedding space: minilm (offline), t5-small, t5:PATH, hf:PATH, or a table over a "
              "base encoder's vocabulary: token-table[:BASE], random-table[:BASE], learned-table[:BASE]",
              _size_help("space"), "--space", parse_space, str),
    part_flag("space", "dim", "vector size of a random-table / learned-table space",
              ", ".join(f"{v['space_dim']} for {name}'s default space" for name, v in SIZE_DEFAULTS.items()
                        if v["space_dim"]) + ", else the base encoder's", "--space-dim"),
    part_flag("space", "seed", "seed of a random-table / learned-table space's vectors", "0", "--space-seed"),
    part_flag("space", "latent_std", "divide encoder outputs by this: a number, 'auto' (estimated on a sample) or "
              "'table' (a table's own std)", "the space's", "--latent-std", typ=latent_std_of),
    part_flag("short_run", "skip", "denoise head: none = the released networks' x = head(h); gaussian = the data's "
              "per-dimension Gaussian posterior mean + posterior std x head(h), a network that starts as that "
              "baseline denoiser; gated = the same with its pass-through of z gated by the network "
              "(elflow.model.ShortRunOptions)"),
    part_flag("short_run", "time_scale", "factor on t before its sinusoid features (1 in the released networks, "
              "whose features then barely change over t in [0, 0.1]; DiT uses 1000)"),
    part_flag("short_run", "head_modulation", "scale and shift the denoise head's input by t (DiT's final layer; "
              "absent from the released networks)"),
    part_flag("short_run", "table_readout", "weight w of the readout's table match: the decode logits gain "
              "w z . R_k / sqrt(C), R_k token k's own vector in the space (table spaces only; 0 in the released "
              "networks)"),
    part_flag("task", "source_length", "train on (source, target) pairs whose sources take up to this many tokens; "
              "--data is then a .jsonl of pairs, a named task or a hub pair set", "none: plain text"),
    part_flag("task", "source_slot", "where a pair's target starts: 'packed', right after its source (the released "
              "layout); 'fixed', at --source-length in every row, the source's slot padded, so a target token sits "
              "at a fixed distance from the source token it copies", PACKED),
    part_flag("task", "name", "a named conditional task, stored with the model (set by --defaults wmt14-de-en / "
              "xsum)", "none", "--task"),
    part_flag("task", "source_field", "the source field of pair records", Task.source_field),
    part_flag("task", "target_field", "the target field of pair records", Task.target_field),
    part_flag("sampling", "steps", "the model's default sampling steps (stored in its record: its previews, elflow "
              "sample and elflow eval use them)", _kind_help("steps") + ", a distilled student's own",
              "--sample-steps"),
    part_flag("sampling", "sampler", "the model's default sampler (stored likewise)",
              _kind_help("sampler") + ", map for a flow-map student", "--sample-sampler"),
    part_flag("sampling", "omega", "the model's default self-conditioning guidance scale omega (stored likewise)",
              _kind_help("omega"), "--sample-omega"),
))


# the recipe's flags (one per constant of elflow.flow.Recipe): their help; their ranges are RECIPE_RANGES and
# their defaults the released recipe's, read from there
RECIPE_HELP = {
    "noise_scale": "ELF: the noise scale of the training path and of sampling's z0",
    "t_mean": "ELF: mean of the logit-normal training times t = sigmoid(N(mean, std^2)) (and of the sampling grid)",
    "t_std": "ELF: std of the logit-normal training times (and of the sampling grid)",
    "decode_prob": "ELF: share of rows in the decode branch (the denoiser has the rest)",
    "self_cond_prob": "ELF: share of denoise rows that are self-conditioned; 0 builds the network without the "
                      "self-conditioning input and turns its guidance off",
    "omega_low": "ELF: lowest training guidance scale omega",
    "omega_high": "ELF: highest training guidance scale omega",
    "source_drop_prob": "ELF on pairs: share of rows whose source is dropped (the unconditional half of source "
                        "guidance)",
    "decode_noise_scale": "decode corruption scale",
    "decode_clean_prob": "share of the decode rows' tokens given clean (p = 1) instead of a corrupted level (the "
                         "released levels almost never come near 1)",
}


def _recipe_default(name: str) -> str:
    value = getattr(Recipe(), name)
    if name == "decode_noise_scale":
        return f"{value:g}; {recipe_for({}, conditional=True).decode_noise_scale:g} for conditional runs"
    return f"{value:g}, as released"


NESTED_FLAGS.update(nested_flag("recipe", name, float, text, RECIPE_RANGES[name], _recipe_default(name))
                    for name, text in RECIPE_HELP.items())


MUTABLE = tuple(f.name for f in fields(TrainConfig) if f.metadata.get("mutable"))
# how a run steps that a newer elflow does otherwise: a run that continues keeps its own
KEPT_FROM_EARLIER = tuple(f.name for f in fields(TrainConfig) if f.metadata.get("kept"))


def kept_from(stored: TrainConfig, cfg: TrainConfig) -> TrainConfig:
    """`cfg` (a distillation's config, rebuilt from its teacher) stepping as the stored run it continues does."""
    return replace(cfg, **{k: getattr(stored, k) for k in KEPT_FROM_EARLIER})


def resume_conflicts(stored: TrainConfig, cfg: TrainConfig, device=None) -> list[str]:
    """'name: stored -> new' for every setting that differs and may not change on resume, a typed part's by its
    fields ('network.depth: 2 -> 3'); dtype "auto" read as what it picks on `device`, if given. A setting the
    record holds (and the network a run asks for), or a field of one, that is not given (None) is the stored
    one."""
    a, b = stored.resolved(device).to_dict(), cfg.resolved(device).to_dict()
    held = (*held_settings(stored.method), "network")
    out = []
    for k in a:
        kept = k in held
        if k in MUTABLE or a[k] == b[k] or kept and b[k] is None:
            continue
        if isinstance(a[k], dict) and isinstance(b[k], dict):
            out += [f"{k}.{f}: {a[k].get(f)!r} -> {v!r}" for f, v in b[k].items()
                    if v != a[k].get(f) and not (kept and v is None)]
        else:
            out.append(f"{k}: {a[k]!r} -> {b[k]!r}")
    return out


def check_setting(name: str, value) -> None:
    """One TrainConfig setting given as a flag by a command that builds the config itself (elflow distill),
    checked by its own declaration (`check_value`); ELFError naming the flag."""
    f = next((f for f in fields(TrainConfig) if f.name == name), None)
    if f is None:
        raise ValueError(f"TrainConfig has no setting {name!r}")
    if value is not None:
        check_value(flag_of(f), KINDS[f.type], value, f.metadata.get("choices"), f.metadata.get("check"))


def flag_of(f) -> str:
    """The command-line flag of a TrainConfig field."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def mutable_flags() -> str:
    """The flags --resume may change: those of the mutable settings, a typed part's by its fields' flags."""
    flags = [[n.flag for (part, _), n in NESTED_FLAGS.items() if part == k] or ["--" + k.replace("_", "-")]
             for k in MUTABLE]
    return ", ".join(f for group in flags for f in group)
