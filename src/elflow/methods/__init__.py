"""The training methods by name: ELF (elflow.methods.elf) and the token-level baselines AR and MDLM. Commands
ask a method what its models can do (`require`) instead of comparing its name."""

from __future__ import annotations

from dataclasses import MISSING, fields

from elflow.flow import recipe_for
from elflow.methods import ar, elf, mdlm
from elflow.methods.base import Method, TrainedPass
from elflow.methods.baseline import MATCHES, BaselineSampling, trunk_params
from elflow.model import ELFConfig
from elflow.util.errors import ELFError

__all__ = ["METHODS", "METHOD_NAMES", "MATCHES", "Method", "TrainedPass", "BaselineSampling", "get_method",
           "require", "check_run", "settings_from_args", "SAMPLING_FLAGS", "trunk_params", "ar", "elf", "mdlm"]


METHODS: dict[str, Method] = {m.name: m for m in (elf.METHOD, ar.METHOD, mdlm.METHOD)}


METHOD_NAMES = tuple(METHODS)


# every method's sampling flags (their union), besides --seed and --batch
SAMPLING_FLAGS = tuple(dict.fromkeys(k for m in METHODS.values() for k in m.knobs))


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ELFError(f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}")
    return METHODS[name]


def _owners(feature: str) -> list[Method]:
    return [m for m in METHODS.values() if feature in m.features]


def require(method: Method, feature: str, what: str, path=None) -> None:
    """ELFError unless models of `method` have `feature` (a key of base.FEATURES): `what` (a flag or a
    command) needs a model of a method that has it."""
    if feature in method.features:
        return
    where = f"{path} holds" if path is not None else "this is"
    who = " or ".join(m.title for m in _owners(feature))
    raise ELFError(f"{where} {method.title} (--method {method.name}); {what} needs {who}")


# the run settings that need a feature of the method: (setting, its flag, the feature); a setting counts as
# used when it differs from its default
RUN_FEATURES = (("task", "--source-length", "pairs"),
                ("init_from", "--init-from", "init-from"), ("grad_checkpoint", "--grad-checkpoint", "grad-checkpoint"),
                *((name, "--" + name.split(".")[-1].replace("_", "-"), "flow") for name in
                  ("network.predict", "network.conditioning", "network.bottleneck", "network.decoder",
                   "decoder_steps", "decoder_from")))


# the ELF network's variants as a network without them has them (any bottleneck given is one)
VARIANT_DEFAULTS = {k: getattr(ELFConfig, k) for k in ("predict", "conditioning", "decoder")}


def _used(cfg, name: str):
    """The flag-like name of a setting of `cfg` that differs from its default, else None (a network variant:
    given, and not the one a network without it has); the recipe names its first field that differs from the released
    recipe of the run's kind."""
    if name.startswith("network."):
        key = name.split(".")[1]
        value = getattr(cfg.network, key)
        return key if value not in (None, VARIANT_DEFAULTS.get(key)) else None
    value = getattr(cfg, name)
    if name == "recipe":
        if value is None:
            return None
        released = recipe_for({}, conditional=cfg.conditional).to_dict()
        return next((k for k, v in value.to_dict().items() if v != released[k]), None)
    default = next(f for f in fields(cfg) if f.name == name)
    return name if value != (None if default.default is MISSING else default.default) else None


def check_run(cfg) -> None:
    """ELFError naming the first setting of `cfg` (a TrainConfig) that its method cannot train with."""
    method = get_method(cfg.method)
    for name, flag, feature in (*RUN_FEATURES, ("recipe", None, "flow")):
        used = _used(cfg, name)
        if used and feature not in method.features:
            who = " or ".join(m.name.upper() for m in _owners(feature))
            raise ELFError(f"{flag or '--' + used.replace('_', '-')} applies to {who} runs only, not to --method "
                           f"{method.name}")
    method.check(cfg)


def settings_from_args(record, args):
    """The sampler settings of a model (its RunRecord, elflow.runs.record) from the sampling flags of
    elflow.cli.common.add_sampling_arguments: its own defaults with the flags given on top; a flag its sampler
    does not take is a one-line error."""
    given = {k: getattr(args, k, None) for k in SAMPLING_FLAGS}
    return get_method(record.method).sampling_settings(record, seed=getattr(args, "seed", None),
                                                       batch_size=getattr(args, "batch", None), **given)
