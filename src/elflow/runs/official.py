"""The authors' released checkpoints: their file format, their parameter names, the network shape inferred
from weights, the released models' layouts and sampling defaults, and `elflow convert`.

Their file is one torch.save dict ("params", "ema_params1", optimiser state, step), read with
torch.load(weights_only=True). The only layout differences are names and the decode head, which they store
as (in, out) kernels where elflow uses nn.Linear (out, in).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from elflow.flow import recipe_for
from elflow.generate import model_sampling
from elflow.methods.elf import network_from_state_dict
from elflow.model import PRESETS, ELFConfig
from elflow.runs.checkpoint import write_checkpoint
from elflow.util.errors import ELFError


# ----------------------------------------------------------------------------------------------------------
# the authors' released checkpoints: one torch.save file `checkpoint_<step>` holding a dict with "params" (the
# model state dict), "ema_params1" (the EMA weights, used for sampling), optimiser state and the step. Read
# with torch.load(weights_only=True), which refuses anything but tensors and plain containers.
def find_official_file(path: str | os.PathLike) -> Path:
    """A `checkpoint_<N>` file, or the one with the largest N in a folder."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        found = [(int(m.group(1)), p) for p in path.iterdir() if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]
        if found:
            return max(found)[1]
        raise ELFError(f"{path}: no checkpoint_<step> file in this folder")
    raise ELFError(f"{path}: no such file or folder")


def read_official_checkpoint(path: str | os.PathLike, which: str = "ema_params1") -> dict[str, torch.Tensor]:
    """Their checkpoint file -> elflow-named state dict of `which` ("ema_params1" or "params")."""
    path = find_official_file(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError for foreign objects, RuntimeError for truncated files
        raise ELFError(f"{path}: cannot be read as a tensors-only checkpoint ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200]}). It is truncated, corrupted, or holds arbitrary "
                       "Python objects, which elflow never unpickles.") from None
    if not isinstance(ckpt, dict) or "params" not in ckpt:
        keys = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ELFError(f"{path}: not an ELF checkpoint (expected a dict with 'params' and 'ema_params1', got {keys})")
    sd = ckpt.get(which) or ckpt["params"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ELFError(f"{path}: '{which}' is not a dict of tensors")
    return official_to_elflow(dict(sd))


def build_from_state_dict(sd: dict[str, torch.Tensor], max_length: int = 1024, heads: int | None = None,
                          config: ELFConfig | None = None, options=None):
    """An ELF network holding these (elflow-named) weights, its shape inferred unless `config` is given."""
    config = config or infer_config(sd, max_length=max_length, heads=heads)
    return network_from_state_dict(sd, config, options)


AUTHORS_SPACE = {"kind": "t5", "name": "t5-small", "latent_std": 0.2}  # the released models' space


# the released conditional and distilled models: their layout and sampling defaults (known without flags)
RELEASES = {
    "ELF-B-de-en-torch": {"task": "wmt14-de-en", "length": 128, "source_length": 64,
                          "sampling": model_sampling(conditional=True)},
    "ELF-B-xsum-torch": {"task": "xsum", "length": 1088, "source_length": 1024,
                         "sampling": model_sampling(conditional=True)},
    "ELF-B-PD-owt-torch": {"distilled": True},
}


def authors_settings(folder: Path, name: str) -> dict:
    """Layout and sampling defaults of an authors' checkpoint: its release's, then a config.json beside it
    (max_length, max_input_length)."""
    out = dict(next((v for k, v in RELEASES.items() if k in name), {}))
    f = folder / "config.json"
    if f.exists():
        try:
            cfg = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            cfg = {}
        if isinstance(cfg, dict):
            for key, ours in (("max_length", "length"), ("max_input_length", "source_length")):
                if isinstance(cfg.get(key), int):
                    out[ours] = cfg[key]
    return out


def convert(src: str | os.PathLike, out: str | os.PathLike, max_length: int | None = None) -> Path:
    """An authors' checkpoint -> an elflow checkpoint folder (safetensors + JSON) that samples, not resumes.
    The layout and sampling defaults of a released conditional or distilled model are kept."""
    f = find_official_file(src)
    ema = read_official_checkpoint(f, which="ema_params1")
    params = read_official_checkpoint(f, which="params")
    settings = authors_settings(f.parent, str(src))
    cfg = infer_config(ema, max_length=max_length or settings.get("length", 1024))
    build_from_state_dict(ema, config=cfg)  # refuses weights that fit no network
    step = int(m.group(1)) if (m := re.fullmatch(r"checkpoint_(\d+)", f.name)) else 0
    state = {"format": "elflow-checkpoint-1", "step": step, "model": cfg.to_dict(), "space": dict(AUTHORS_SPACE),
             "train": {"preset": preset_name(cfg), "converted_from": str(f),
                       "recipe": recipe_for({}, True).to_dict() if settings.get("source_length") else {}},
             "settings": settings, "data_position": None}
    return write_checkpoint(out, params, ema, None, state)


# their name (regex) -> ours; blocks keep their names (blocks.N.norm1, .attn.qkv, .attn.q_norm, ...)
RENAMES = [
    (r"^t_emb_tokens$", "time_tokens"),
    (r"^self_cond_cfg_tokens$", "omega_tokens"),
    (r"^mode_tokens$", "mode_tokens"),
    (r"^self_cond_proj\.(weight|bias)$", r"self_cond_proj.\1"),
    (r"^text_proj\.proj1\.weight$", "bottleneck_in.weight"),
    (r"^text_proj\.proj2\.(weight|bias)$", r"bottleneck_out.\1"),
    (r"^t_embedder\.mlp_0\.(weight|bias)$", r"time_embed.fc1.\1"),
    (r"^t_embedder\.mlp_2\.(weight|bias)$", r"time_embed.fc2.\1"),
    (r"^self_cond_cfg_embedder\.mlp_0\.(weight|bias)$", r"omega_embed.fc1.\1"),
    (r"^self_cond_cfg_embedder\.mlp_2\.(weight|bias)$", r"omega_embed.fc2.\1"),
    (r"^(blocks\.\d+\.(?:norm1|norm2)\.weight)$", r"\1"),
    (r"^(blocks\.\d+\.attn\.(?:qkv|proj)\.(?:weight|bias))$", r"\1"),
    (r"^(blocks\.\d+\.attn\.(?:q_norm|k_norm)\.weight)$", r"\1"),
    (r"^(blocks\.\d+\.mlp\.(?:w12|w3)\.(?:weight|bias))$", r"\1"),
    (r"^final_layer\.norm_final\.weight$", "final_norm.weight"),
    (r"^final_layer\.linear\.(weight|bias)$", r"x_head.\1"),
    (r"^proj_bias$", "decode_head.proj.bias"),
    (r"^unembed_bias$", "decode_head.unembed.bias"),
]


TRANSPOSED = {"proj_kernel": "decode_head.proj.weight", "unembed_kernel": "decode_head.unembed.weight"}


def official_to_elflow(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Their state dict -> elflow's. Unknown keys raise an error naming them."""
    out, unknown = {}, []
    for key, value in sd.items():
        if key.startswith("module."):  # a DDP-wrapped save
            key = key[len("module."):]
        if key in TRANSPOSED:
            out[TRANSPOSED[key]] = value.t().contiguous()
            continue
        for pattern, repl in RENAMES:
            if re.match(pattern, key):
                out[re.sub(pattern, repl, key)] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise ELFError(f"unexpected keys in the authors' checkpoint: {unknown[:8]}"
                       f"{' ...' if len(unknown) > 8 else ''}; is this an ELF checkpoint?")
    return out


def infer_config(sd: dict[str, torch.Tensor], max_length: int = 1024, heads: int | None = None) -> ELFConfig:
    """The network shape from an elflow-named state dict.

    depth, hidden, dim, vocabulary, bottleneck and prefix sizes are read off the shapes. The number of heads
    is not stored anywhere: it is taken from the preset with the same depth and width, from `heads`, or
    from the q_norm width (head_dim) when that is present.
    """
    try:
        hidden = sd["bottleneck_out.weight"].shape[0]
        bottleneck = sd["bottleneck_in.weight"].shape[0]
        dim = sd["x_head.weight"].shape[0]
        vocab = sd["decode_head.unembed.weight"].shape[0]
        head_dim = sd["blocks.0.attn.q_norm.weight"].shape[0]
    except KeyError as e:
        raise ELFError(f"the weights lack {e.args[0]!r}: not an ELF network state dict") from None
    depth = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    from_heads = hidden // head_dim
    if heads is not None and heads != from_heads:
        raise ELFError(f"--heads {heads} contradicts the weights (head dim {head_dim}, so {from_heads} heads)")
    mlp_hidden = sd["blocks.0.mlp.w3.weight"].shape[1]
    cfg = ELFConfig(
        depth=depth, hidden=hidden, heads=from_heads, dim=dim, vocab_size=vocab, max_length=max_length,
        bottleneck=bottleneck, time_tokens=sd["time_tokens"].shape[1], omega_tokens=sd["omega_tokens"].shape[1],
        mode_tokens=sd["mode_tokens"].shape[1], self_cond="self_cond_proj.weight" in sd,
    )
    if cfg.mlp_hidden != mlp_hidden:
        ratio = mlp_hidden * 3 / 2 / hidden
        cfg = cfg.replace(mlp_ratio=ratio)
        if cfg.mlp_hidden != mlp_hidden:
            raise ELFError(f"SwiGLU width {mlp_hidden} fits no mlp ratio for hidden {hidden}")
    return cfg


def preset_name(cfg: ELFConfig) -> str | None:
    """The preset whose depth/width/heads match, if any."""
    for name, p in PRESETS.items():
        if (p.depth, p.hidden, p.heads) == (cfg.depth, cfg.hidden, cfg.heads):
            return name
    return None
