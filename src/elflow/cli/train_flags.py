"""`elflow train`'s flags of the training config, one per TrainConfig field (and nested key), each defaulting to
"not given" so that --resume can tell what the command line changes."""

from __future__ import annotations

import argparse
from dataclasses import fields

from elflow.config import NESTED_FLAGS, RUN_DEFAULTS, TrainConfig, flag_of
from elflow.util.errors import KINDS


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def _replaced_muon_scale(text: str):
    raise argparse.ArgumentTypeError(
        "replaced by --update-rule: its default, released, is now the released update in full (the decode head "
        "scaled by the fan rule like every matrix); --muon-scale fan was --update-rule torch-fan, --muon-scale "
        "released was --update-rule torch-head-transposed")


def with_default(text: str, default_text) -> str:
    """A flag's help text ending in its default, once."""
    return f"{text} (default: {default_text})".replace("%", "%%")


def add_config_arguments(p) -> None:
    """The training config's flags (and --defaults) in a group of `p`."""
    S = argparse.SUPPRESS
    cfg_group = p.add_argument_group("training config (stored in the run's record; --print-config shows it "
                                     "resolved)")
    for f in fields(TrainConfig):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        default_text = meta.get("default_help") or (f.default if f.default is not None else "none")
        kw = dict(default=S, dest=f.name, help=with_default(meta["help"], default_text))
        if f.type == "bool":
            kw["help"] = with_default(meta["help"], "on" if f.default else "off")
            cfg_group.add_argument(flag_of(f), action=argparse.BooleanOptionalAction, **kw)
            continue
        kw["type"] = KINDS[f.type]
        if meta.get("choices"):
            kw["choices"] = meta["choices"]
        else:
            kw["metavar"] = flag_of(f)[2:].upper().replace("-", "_")
        cfg_group.add_argument(flag_of(f), **kw)
    for (key, sub), nested in NESTED_FLAGS.items():
        typ = nested.type
        if isinstance(typ, tuple):
            kind = {"choices": typ}
        elif typ is bool:
            kind = {"type": _true_or_false, "metavar": "true|false"}
        else:
            kind = {"type": typ, "metavar": nested.flag[2:].upper().replace("-", "_")}
        cfg_group.add_argument(nested.flag, default=S, dest=f"{key}.{sub}", **kind,
                               help=with_default(nested.help, nested.default_help))
    cfg_group.add_argument("--muon-scale", default=S, dest="muon_scale", type=_replaced_muon_scale, help=S)
    cfg_group.add_argument("--defaults", default=S, choices=tuple(RUN_DEFAULTS),
                           help=with_default("start from a named training config, elflow.config.RUN_DEFAULTS "
                                             "(quickstart: what `elflow quickstart` trains; the paper's conditional "
                                             "tasks); other flags override it. --preset is the network's size",
                                             "none"))


def given_config(args, base: dict | None = None) -> dict:
    """The TrainConfig values given on the command line, a nested flag setting one key of its dict: of the
    dict given whole on the command line, else of `base`'s (the --defaults preset's values: `--skip gated`
    over the quickstart keeps its other short-run options), else of an empty one."""
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    for (key, sub), nested in NESTED_FLAGS.items():
        if hasattr(args, f"{key}.{sub}"):
            value = getattr(args, f"{key}.{sub}")
            part = given.setdefault(key, dict((base or {}).get(key) or {}))
            part.update(nested.fields(value) if nested.fields else {sub: value})
    return given
