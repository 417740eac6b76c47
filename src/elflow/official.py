"""The authors' released checkpoints: read them safely, map their keys onto elflow's network, infer the size.

Their checkpoint is one `torch.save` file `checkpoint_<step>` holding a dict with "params" (the model
state dict), "ema_params1" (the EMA weights, used for sampling), optimiser state and the step. It is read
with `torch.load(weights_only=True)`, which refuses anything but tensors and plain containers.

The only layout differences live here: names, and the decode head, which they store as (in, out)
kernels where elflow uses nn.Linear (out, in).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from elflow.model import ELF, PRESETS, ELFConfig
from elflow.utils import ELFError

__all__ = [
    "official_to_elflow",
    "elflow_to_official",
    "infer_config",
    "read_official_checkpoint",
    "find_official_file",
    "is_official_state_dict",
]

# their name (regex) -> ours; blocks keep their names (blocks.N.norm1, .attn.qkv, .attn.q_norm, ...)
_RENAMES = [
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
_TRANSPOSED = {"proj_kernel": "decode_head.proj.weight", "unembed_kernel": "decode_head.unembed.weight"}


def is_official_state_dict(sd: dict) -> bool:
    return "t_emb_tokens" in sd or "unembed_kernel" in sd


def official_to_elflow(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Their state dict -> elflow's. Unknown keys raise an error naming them."""
    out, unknown = {}, []
    for key, value in sd.items():
        if key.startswith("module."):  # a DDP-wrapped save
            key = key[len("module."):]
        if key in _TRANSPOSED:
            out[_TRANSPOSED[key]] = value.t().contiguous()
            continue
        for pattern, repl in _RENAMES:
            if re.match(pattern, key):
                out[re.sub(pattern, repl, key)] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise ELFError(f"unexpected keys in the authors' checkpoint: {unknown[:8]}"
                       f"{' ...' if len(unknown) > 8 else ''}; is this an ELF checkpoint?")
    return out


def elflow_to_official(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """elflow's state dict -> the authors' names and layouts (the exact inverse of official_to_elflow)."""
    inverse_t = {v: k for k, v in _TRANSPOSED.items()}
    fixed = {
        "time_tokens": "t_emb_tokens", "omega_tokens": "self_cond_cfg_tokens",
        "bottleneck_in.weight": "text_proj.proj1.weight", "bottleneck_out.weight": "text_proj.proj2.weight",
        "bottleneck_out.bias": "text_proj.proj2.bias", "final_norm.weight": "final_layer.norm_final.weight",
        "x_head.weight": "final_layer.linear.weight", "x_head.bias": "final_layer.linear.bias",
        "decode_head.proj.bias": "proj_bias", "decode_head.unembed.bias": "unembed_bias",
    }
    out = {}
    for key, value in sd.items():
        if key in inverse_t:
            out[inverse_t[key]] = value.t().contiguous()
            continue
        name = fixed.get(key, key)
        name = re.sub(r"^time_embed\.fc1", "t_embedder.mlp_0", name)
        name = re.sub(r"^time_embed\.fc2", "t_embedder.mlp_2", name)
        name = re.sub(r"^omega_embed\.fc1", "self_cond_cfg_embedder.mlp_0", name)
        name = re.sub(r"^omega_embed\.fc2", "self_cond_cfg_embedder.mlp_2", name)
        out[name] = value
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
                          config: ELFConfig | None = None) -> ELF:
    """An ELF network holding these (elflow-named) weights, its shape inferred unless `config` is given."""
    cfg = config or infer_config(sd, max_length=max_length, heads=heads)
    net = ELF(cfg)
    expected = net.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise ELFError(f"weights do not fit an ELF network of shape {cfg}: missing {missing[:6]}, "
                       f"unexpected {unexpected[:6]}")
    wrong = [f"{k}: {tuple(sd[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
             if sd[k].shape != v.shape]
    if wrong:
        raise ELFError(f"weights have shapes that fit no ELF network of this shape: {wrong[:4]}")
    net.load_state_dict(sd)
    return net


# ----------------------------------------------------------------------------------------------------------
# `elflow convert`


def convert(src: str | os.PathLike, out: str | os.PathLike, max_length: int = 1024) -> Path:
    """An authors' checkpoint -> an elflow checkpoint folder (safetensors + JSON) that samples, not resumes."""
    from elflow.checkpoint import write_checkpoint
    from elflow.generate import AUTHORS_SPACE

    f = find_official_file(src)
    ema = read_official_checkpoint(f, which="ema_params1")
    params = read_official_checkpoint(f, which="params")
    cfg = infer_config(ema, max_length=max_length)
    build_from_state_dict(ema, config=cfg)  # refuses weights that fit no network
    step = int(m.group(1)) if (m := re.fullmatch(r"checkpoint_(\d+)", f.name)) else 0
    state = {"format": "elflow-checkpoint-1", "step": step, "model": cfg.to_dict(), "space": dict(AUTHORS_SPACE),
             "train": {"preset": preset_name(cfg), "converted_from": str(f)}, "data_position": None}
    return write_checkpoint(out, params, ema, None, state)


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="the authors' checkpoint_<step> file, or a folder holding one")
    p.add_argument("out", help="the elflow checkpoint folder to write")
    p.add_argument("--max-length", type=int, default=1024, help="longest sequence the converted model samples")


def run(args) -> int:
    out = convert(args.checkpoint, args.out, args.max_length)
    print(f"wrote {out}")
    return 0
