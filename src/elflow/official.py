"""The authors' parameter names mapped onto elflow's network, and the network's shape inferred from weights.

The only layout differences live here: names, and the decode head, which they store as (in, out) kernels
where elflow uses nn.Linear (out, in). Reading their files is `checkpoint`'s job.
"""

from __future__ import annotations

import re

import torch

from elflow.model import PRESETS, ELFConfig
from elflow.utils import ELFError

__all__ = [
    "official_to_elflow",
    "elflow_to_official",
    "infer_config",
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
