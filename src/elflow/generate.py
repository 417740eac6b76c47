"""`elflow sample`: load a network (an elflow run or checkpoint, or the authors' released checkpoint) with its
EMA weights and embedding space, generate passages, and write them as JSONL.

    load_network(path)        -> ELF in eval mode with the EMA weights
    load_for_sampling(path)   -> (ELF, embedding space)
    generate_texts(net, space, num, ...) -> list of texts (cut at the first EOS, special tokens skipped)
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from elflow.flow import Recipe, check_sampling_args, decode_tokens, generate_tokens
from elflow.model import ELF, ELFConfig
from elflow.utils import ELFError, atomic_write

__all__ = ["load_network", "load_for_sampling", "generate_texts", "generate_batch", "add_arguments", "run"]

AUTHORS_SPACE = {"kind": "t5", "name": "t5-small", "latent_std": 0.2}  # the released models' space


def _is_hub_id(s: str) -> bool:
    return "/" in s and not os.path.exists(s) and s.count("/") == 1 and not s.startswith((".", "/", "~"))


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ELFError("loading from the Hugging Face Hub needs huggingface_hub: pip install huggingface_hub") from None
    from elflow.utils import hub_offline, hub_reachable, hub_unavailable_reason

    if not hub_offline() and not hub_reachable():
        raise ELFError(f"{repo_id}: no such local file or folder; read as a Hugging Face Hub id, it cannot be "
                       f"fetched ({hub_unavailable_reason()}). Check the path.")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["checkpoint_*", "*.json", "*.yml", "*.yaml", "*.md"]))
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ELFError(f"{repo_id}: no such local file or folder; read as a Hugging Face Hub id, it could not be "
                       f"fetched ({type(e).__name__}: {first}). Check the path, or, without a hub, download the "
                       "checkpoint_<step> file elsewhere and pass its path.") from None


def _official_length(folder: Path, default: int = 1024) -> int:
    """max_length from a config.json next to the authors' checkpoint, if there is one."""
    f = folder / "config.json"
    if f.exists():
        try:
            return int(json.loads(f.read_text()).get("max_length", default))
        except (ValueError, json.JSONDecodeError, AttributeError):
            pass
    return default


def load_weights(path: str | os.PathLike, use_ema: bool = True, max_length: int | None = None):
    """-> (ELFConfig, state dict, space spec, info dict) for an elflow run/checkpoint or the authors' format."""
    from elflow.checkpoint import is_elflow_checkpoint, load_checkpoint, resolve_checkpoint
    from elflow.official import find_official_file, infer_config, read_official_checkpoint

    s = str(path)
    p = Path(s).expanduser()
    if _is_hub_id(s):
        p = _download(s)
    if not p.exists():
        raise ELFError(f"{s}: no such file or folder (nor a hub id of the form owner/name)")
    if is_elflow_checkpoint(p) or (p / "checkpoints").is_dir():
        ckpt = resolve_checkpoint(p)
        blob = load_checkpoint(ckpt, with_optimizer=False)
        st = blob["state"]
        cfg = ELFConfig.from_dict({**st["model"], "grad_checkpoint": False})
        sd = blob["ema" if use_ema else "model"]
        sd = {k: v for k, v in sd.items() if not k.startswith("space.")}
        if max_length and max_length > cfg.max_length:
            cfg = cfg.replace(max_length=max_length)
        return cfg, sd, st["space"], {"format": "elflow", "checkpoint": str(ckpt), "space_id": st.get("space_id"),
                                       "recipe": st.get("train", {}).get("recipe", {})}
    f = find_official_file(p)
    sd = read_official_checkpoint(f, which="ema_params1" if use_ema else "params")
    length = max_length or _official_length(f.parent)
    cfg = infer_config(sd, max_length=length)
    return cfg, sd, dict(AUTHORS_SPACE), {"format": "official", "checkpoint": str(f), "recipe": {}}


def load_network(path: str | os.PathLike, device=None, use_ema: bool = True, max_length: int | None = None) -> ELF:
    """The network of a run, checkpoint or released model, with its EMA weights, in eval mode."""
    from elflow.official import build_from_state_dict

    cfg, sd, _, _ = load_weights(path, use_ema=use_ema, max_length=max_length)
    net = build_from_state_dict(sd, config=cfg)
    return net.to(device or "cpu").eval()


def load_for_sampling(path_or_hub_id, device=None, dtype=None, space=None, use_ema: bool = True,
                      max_length: int | None = None):
    """(network, embedding space). `space` overrides the stored one: a build_space spec, a folder or hub id
    of a T5 encoder (for the authors' checkpoints offline), or a ready space object."""
    from elflow.encoders import EmbeddingSpace, build_space, check_compatible
    from elflow.official import build_from_state_dict

    cfg, sd, spec, info = load_weights(path_or_hub_id, use_ema=use_ema, max_length=max_length)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    net = build_from_state_dict(sd, config=cfg).to(device).eval()
    if isinstance(space, EmbeddingSpace):
        sp = space
    elif isinstance(space, dict):
        sp = build_space(space, device=device)
    elif isinstance(space, str) and space:
        sp = build_space({**spec, "name": space} if spec.get("kind") in ("t5", "hf") else {"kind": "t5", "name": space,
                                                                                         "latent_std": 0.2},
                         device=device)
    else:
        sp = build_space(spec, device=device)
    if info.get("space_id"):
        check_compatible(info["space_id"], sp)
    if sp.dim != cfg.dim or sp.vocab_size < cfg.vocab_size:
        raise ELFError(f"the embedding space ({sp.space_id}: dim {sp.dim}, vocabulary {sp.vocab_size}) does not fit "
                       f"the network (dim {cfg.dim}, vocabulary {cfg.vocab_size})")
    net.elflow_info = info
    return net, sp


def _autocast(device, dtype):
    if dtype in ("bf16", torch.bfloat16):
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()
def generate_batch(net, batch: int, length: int, steps: int = 32, sampler: str = "sde", gamma: float = 1.5,
                   omega: float = 3.0, seed: int = 0, grid: str = "logit_normal", dtype=None,
                   trajectory_steps=None, recipe: Recipe = Recipe()):
    """One batch of token ids (B, L), and the decoded guesses at the chosen steps if asked."""
    device = next(net.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    seen = {}

    def keep(i, t, z, x_pred):
        if trajectory_steps is not None and i in trajectory_steps:
            seen[i] = (float(t), x_pred.clone())

    with _autocast(device, dtype):
        tokens, _ = generate_tokens(net, batch, length, steps, sampler, gamma, omega, grid, g, recipe,
                                    device, callback=keep if trajectory_steps is not None else None)
        traj = {}
        w = torch.full((batch,), float(omega), device=device)
        for i, (t, x_pred) in sorted(seen.items()):
            traj[i] = (t, decode_tokens(net, x_pred, w))
    return tokens, traj


def generate_texts(net, space, num: int, length: int | None = None, steps: int = 32, sampler: str = "sde",
                   gamma: float = 1.5, omega: float = 3.0, batch_size: int = 8, seed: int = 0,
                   grid: str = "logit_normal", device=None, progress: bool = True, dtype=None) -> list[str]:
    """`num` texts; batch i is seeded by (seed, i), so the same settings give the same texts."""
    return [r["text"] for r in _generate(net, space, num, length, steps, sampler, gamma, omega, batch_size, seed,
                                         grid, progress, dtype)[0]]


def _generate(net, space, num, length, steps, sampler, gamma, omega, batch_size, seed, grid, progress, dtype,
              trajectory_steps=None):
    if num < 1 or batch_size < 1:
        raise ELFError(f"--num and --batch must be >= 1 (got {num}, {batch_size})")
    length = length or net.config.max_length
    if length > net.config.max_length:
        raise ELFError(f"--length {length} exceeds the network's max_length {net.config.max_length}")
    try:
        check_sampling_args(steps, gamma, omega)
    except ValueError as e:
        raise ELFError(str(e)) from None
    from tqdm.auto import tqdm

    records, traj_out = [], None
    n_batches = (num + batch_size - 1) // batch_size
    bar = tqdm(total=num, desc="sample", unit="text", disable=not progress, file=sys.stderr)
    for b in range(n_batches):
        bs = min(batch_size, num - b * batch_size)
        tokens, traj = generate_batch(net, bs, length, steps, sampler, gamma, omega, seed * 100_003 + b, grid,
                                      dtype, trajectory_steps if b == 0 else None)
        for j, text in enumerate(space.decode(tokens.cpu())):
            records.append({"text": text, "index": b * batch_size + j})
        if traj:
            traj_out = {i: (t, space.decode(tok.cpu())) for i, (t, tok) in traj.items()}
        bar.update(bs)
    bar.close()
    return records, traj_out


def _trained_length(net) -> int | None:
    """The sequence length the network was trained at, from its checkpoint's state.json (None if unknown)."""
    info = getattr(net, "elflow_info", {}) or {}
    if info.get("format") != "elflow":
        return None
    try:
        state = json.loads((Path(info["checkpoint"]) / "state.json").read_text())
        return int(state["train"].get("length") or state["model"]["max_length"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def add_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                   help="an elflow run folder or checkpoint folder, an authors' checkpoint_<step> file or its "
                        "folder, or a hub id such as embedded-language-flows/ELF-B-owt-torch")
    p.add_argument("--steps", type=int, default=32, help="sampling steps N")
    p.add_argument("--sampler", choices=["ode", "sde", "vc"], default="sde",
                   help="ode: Euler; sde: the released SDE-style step; vc: variance-consistent re-noising")
    p.add_argument("--gamma", type=float, default=1.5, help="SDE back-off scale")
    p.add_argument("--omega", type=float, default=3.0, help="self-conditioning guidance scale")
    p.add_argument("--grid", choices=["logit_normal", "uniform"], default="logit_normal")
    p.add_argument("--num", type=int, default=16, help="number of samples")
    p.add_argument("--batch", type=int, default=8, help="samples per batch")
    p.add_argument("--length", type=int, default=None, help="positions per sample (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="samples.jsonl", help="JSONL output (one object per sample)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="autocast precision")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--raw-weights", action="store_true", help="use the trained weights instead of the EMA")
    p.add_argument("--encoder", default=None,
                   help="T5 encoder folder or hub id for the authors' checkpoints (default t5-small)")
    p.add_argument("--trajectory", nargs="*", type=int, default=None, metavar="STEP",
                   help="print the decode readout of the current guess at these steps (default: 6 spread out)")
    p.add_argument("--quiet", action="store_true", help="do not print the texts")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


def check_checkpoint_path(path) -> None:
    """Refuse, before anything is loaded, a path that is a file but no checkpoint (a text file, say)."""
    p = Path(str(path)).expanduser()
    if p.is_file():
        with open(p, "rb") as f:
            head = f.read(4)
        if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch.save's zip, or a pickle
            raise ELFError(f"{p}: not a checkpoint; pass an elflow run or checkpoint folder, or an authors' "
                           "checkpoint_<step> file")


def run(args) -> int:
    from elflow.utils import check_device, check_output

    args.device = check_device(args.device)
    check_checkpoint_path(args.checkpoint)
    check_output(args.out, args.overwrite)  # before any sampling work
    if args.length is not None and args.length < 1:
        raise ELFError(f"--length must be >= 1, got {args.length}")
    net, space = load_for_sampling(args.checkpoint, device=args.device, space=args.encoder,
                                   use_ema=not args.raw_weights,
                                   max_length=args.length if args.length and args.length > 0 else None)
    trained = _trained_length(net)
    if args.length and trained and args.length > trained:
        print(f"warning: --length {args.length} is longer than the {trained} positions the model was trained on; "
              "expect poorer samples", file=sys.stderr)
    traj_steps = None
    if args.trajectory is not None:
        n = args.steps
        traj_steps = set(args.trajectory) if args.trajectory else {round(i * (n - 1) / 5) for i in range(6)}
        bad = [s for s in traj_steps if not 0 <= s < n]
        if bad:
            raise ELFError(f"--trajectory steps must lie in 0..{n - 1}, got {sorted(bad)}")
    records, traj = _generate(net, space, args.num, args.length, args.steps, args.sampler, args.gamma, args.omega,
                              args.batch, args.seed, args.grid, not args.quiet, args.dtype, traj_steps)
    settings = {"steps": args.steps, "sampler": args.sampler, "gamma": args.gamma, "omega": args.omega,
                "grid": args.grid, "seed": args.seed, "length": args.length or net.config.max_length,
                "dtype": args.dtype, "ema": not args.raw_weights, "checkpoint": str(args.checkpoint)}
    with atomic_write(args.out, "w") as f:
        for r in records:
            f.write(json.dumps({**r, **settings}) + "\n")
    if traj:
        print("how sample 0 emerges (decode readout of the guess at each chosen step):")
        for i, (t, texts) in sorted(traj.items()):
            print(f"  step {i:>3} (t = {t:.3f}): {texts[0][:200]}")
    if not args.quiet:
        for r in records:
            print(f"--- sample {r['index']}\n{r['text']}")
    print(f"wrote {len(records)} samples to {args.out}", file=sys.stderr)
    return 0
