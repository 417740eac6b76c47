"""The released checkpoints (of the authors' PyTorch port): their file format, their parameter names, the
network shape inferred from weights and the released models' layouts (elflow.runs.load.convert_released
converts one).

Their file is one torch.save dict ("params", "ema_params1", optimiser state, step), read with
torch.load(weights_only=True). The only layout differences are names and the decode head, which they store
as (in, out) kernels where elflow uses nn.Linear (out, in).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from elflow.data.tasks import PAIR_TASKS
from elflow.model import ELFConfig
from elflow.util.errors import ELFError
from elflow.util.files import read_json
from elflow.util.jsonio import open_regular

RELEASED_LENGTH = ELFConfig.max_length  # the released unconditional models' sequence length (1,024)


# ----------------------------------------------------------------------------------------------------------
# the released checkpoints: one torch.save file `checkpoint_<step>` holding a dict with "params" (the
# model state dict), "ema_params1" (the EMA weights, used for sampling), optimiser state and the step. Read
# with torch.load(weights_only=True), which refuses anything but tensors and plain containers.
def find_released_file(path: str | os.PathLike) -> Path:
    """A `checkpoint_<N>` file, or the one with the largest N in a folder."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        found = [(int(m.group(1)), p) for p in path.iterdir() if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]
        if found:
            newest = max(found)[1]
            if not newest.is_file():
                raise ELFError(f"{newest}: not a regular file (a fifo, a device or a folder); a released "
                               "checkpoint is one file")
            return newest
        raise ELFError(f"{path}: no checkpoint_<step> file in this folder (nor an elflow run, checkpoint or model "
                       "folder)")
    raise ELFError(f"{path}: no such file or folder")


def read_released_checkpoint(path: str | os.PathLike, which: str = "ema_params1") -> dict[str, torch.Tensor]:
    """Their checkpoint file -> elflow-named state dict of `which` ("ema_params1" or "params")."""
    path = find_released_file(path)
    try:
        with open_regular(path, "a released checkpoint") as f:  # never a fifo or a device
            ckpt = torch.load(f, map_location="cpu", weights_only=True)
    except ELFError:
        raise
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
    return released_to_elflow(dict(sd))


RELEASED_SPACE = {"kind": "t5", "name": "t5-small", "latent_std": 0.2}  # the released models' space


# the released conditional and distilled models: their layout (their sampling defaults follow from their kind)
def _task_layout(task: str) -> dict:
    """A released conditional model's layout: its task's (elflow.data.tasks.PAIR_TASKS)."""
    return {"task": task, **{k: PAIR_TASKS[task][k] for k in ("length", "source_length")}}


RELEASES = {
    "ELF-B-de-en-torch": _task_layout("wmt14-de-en"),
    "ELF-B-xsum-torch": _task_layout("xsum"),
    "ELF-B-PD-owt-torch": {"distilled": True},
}


def release_settings(folder: Path, name: str) -> dict:
    """The layout of a released checkpoint: its release's, then a config.json beside it (max_length,
    max_input_length)."""
    out = dict(next((v for k, v in RELEASES.items() if k in name), {}))
    f = folder / "config.json"
    if f.is_file():
        cfg = read_json(f, "the released model's config", own=False)
        for key, ours in (("max_length", "length"), ("max_input_length", "source_length")):
            v = cfg.get(key)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_RELEASED_LENGTH:
                    raise ELFError(f"{f}: {key} must be an integer from 1 to {MAX_RELEASED_LENGTH}, got {v!r}")
                out[ours] = v
    return out


MAX_RELEASED_LENGTH = 1 << 16  # positions: the released models take 1,088 at most


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


def released_to_elflow(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
        raise ELFError(f"unexpected keys in the released checkpoint: {unknown[:8]}"
                       f"{' ...' if len(unknown) > 8 else ''}; is this an ELF checkpoint?")
    return out


def infer_config(sd: dict[str, torch.Tensor], max_length: int = RELEASED_LENGTH, heads: int | None = None) -> ELFConfig:
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
    except (KeyError, IndexError) as e:
        raise ELFError(f"the weights lack {e.args[0]!r}: not an ELF network state dict") from None
    if min(hidden, bottleneck, dim, vocab, head_dim) < 1 or hidden % head_dim:
        raise ELFError(f"the weights' shapes fit no ELF network (hidden {hidden}, head dim {head_dim}, dim {dim}, "
                       f"vocabulary {vocab}, bottleneck {bottleneck})")
    depth = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    from_heads = hidden // head_dim
    if heads is not None and heads != from_heads:
        raise ELFError(f"--heads {heads} contradicts the weights (head dim {head_dim}, so {from_heads} heads)")
    mlp_hidden = sd["blocks.0.mlp.w3.weight"].shape[1]
    try:
        cfg = ELFConfig(
            depth=depth, hidden=hidden, heads=from_heads, dim=dim, vocab_size=vocab, max_length=max_length,
            bottleneck=bottleneck, time_tokens=sd["time_tokens"].shape[1], omega_tokens=sd["omega_tokens"].shape[1],
            mode_tokens=sd["mode_tokens"].shape[1], self_cond="self_cond_proj.weight" in sd,
        )
    except (KeyError, IndexError, ValueError) as e:
        raise ELFError(f"the weights fit no ELF network ({e})") from None
    if cfg.mlp_hidden != mlp_hidden:
        ratio = mlp_hidden * 3 / 2 / hidden
        cfg = cfg.replace(mlp_ratio=ratio)
        if cfg.mlp_hidden != mlp_hidden:
            raise ELFError(f"SwiGLU width {mlp_hidden} fits no mlp ratio for hidden {hidden}")
    return cfg
