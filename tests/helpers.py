"""Small helpers shared by the tests: the reference vectors' folder, a tiny run's settings, a checkpoint's weights,
a small file system to fill."""

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elflow.config import TrainConfig
from elflow.util.errors import ELFError

REFERENCE = Path(__file__).resolve().parent / "reference"
MISSING_DATA = "missing data"  # the reason of a skip for absent files; ELFLOW_STRICT_SKIPS=1 turns it into a failure


EOS = 1


class CharSpace:
    """A stand-in space for layout tests: one token per character (ord + 10), EOS = 1, pad = EOS."""

    eos_id = pad_id = EOS
    tokenizer_id = "chars-v1"
    vocab_size = 0x110000 + 10  # every code point

    def __init__(self, max_length=None):
        self.max_length = max_length
        self.calls = 0

    def tokenize(self, texts, eos=True):
        self.calls += 1
        return [[ord(c) + 10 for c in t] + ([EOS] if eos else []) for t in texts]

    def check_length(self, length):
        if self.max_length is not None and length > self.max_length:
            raise ELFError(f"sequence length {length} is longer than the encoder accepts ({self.max_length})")


class SlowSpace(CharSpace):
    """CharSpace that takes `delay` seconds per tokenize call and appends a line to `log` for each call."""

    def __init__(self, delay: float, log):
        super().__init__()
        self.delay, self.log = delay, str(log)

    def tokenize(self, texts, eos=True):
        import os
        import time

        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(self.delay)
        return super().tokenize(texts, eos)


def assert_one_error(code, err, command, *needles):
    """The command failed with exit 2 and printed exactly one line, its own error, holding every needle; returns
    that line."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"elflow {command}: error: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def assert_not_an_integer(code, err, command, flag):
    """An integer flag given a non-integer (nan, inf) was refused by the command line's parser: exit 2, one
    line, the command's error naming the flag and where the flags are listed."""
    line = assert_one_error(code, err, command, f"argument {flag}: invalid int value")
    assert line.endswith(f"(`elflow {command} --help` lists the flags)"), line


def reference_dir(*names: str) -> Path:
    """tests/reference, after checking that it holds `names` (the authors' reference vectors: README there).
    Usable at module level: a missing file skips the module with a reason that strict runs refuse."""
    missing = [n for n in names if not (REFERENCE / n).exists()]
    if missing:
        pytest.skip(f"{MISSING_DATA}: tests/reference lacks {', '.join(missing)}", allow_module_level=True)
    return REFERENCE


def tiny_config(t5_dir, corpus, **kw) -> TrainConfig:
    """A run of the tiny preset on the tiny corpus in the tiny T5's space: 6 steps, a checkpoint every 3."""
    base = dict(preset="tiny", data=str(corpus), space=f"t5:{t5_dir}", length=16, batch=4, steps=6, warmup=2,
                ema_decay=0.9, log_every=1, ckpt_every=3, keep=5, dtype="fp32", seed=1)
    return TrainConfig(**{**base, **kw})


def checkpoint_weights(run: Path, step: int):
    """(weights, EMA weights) of a run's checkpoint at `step`."""
    ck = Path(run) / "checkpoints" / f"step_{step:07d}"
    return load_file(ck / "model.safetensors"), load_file(ck / "ema.safetensors")


def assert_same(a, b, where: str = "", exact: bool = True, rtol: float = 1e-2, atol: float = 1e-3) -> None:
    """a equals b: tensors by dtype, shape and value (torch.equal; floats to `rtol` / `atol` where not `exact`),
    containers (a state dict, an optimiser's state) item by item, the rest by ==; `where` names the item that
    differs."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: a tensor and a {type(b)}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        same = torch.equal(a, b) if exact or not a.is_floating_point() else \
            torch.allclose(a, b, rtol=rtol, atol=atol)
        assert same, f"{where}: values differ (max |a - b| {(a.double() - b.double()).abs().max()})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, set(a) ^ set(b)))} differ"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]", exact, rtol, atol)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]", exact, rtol, atol)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def tiny_network(**options):
    """The tiny preset's ELF network, drawn from seed 0, with the short-run `options` (none: the paper's
    network)."""
    from elflow.model import build_network, get_config

    torch.manual_seed(0)
    return build_network(get_config("tiny"), options)


def run_alone_and_on_two_ranks(args: list[str], one: Path, two: Path) -> None:
    """`elflow ARGS --out ONE` in one process and `--out TWO` under torchrun with two Gloo ranks."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "elflow.cli", *args, "--out", str(one)], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "elflow.cli", *args, "--out", str(two)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def free_port() -> int:
    """A TCP port of localhost that nothing listens on (at the time of asking)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_under_memory_limit(args: list, limit: int = 6 * 10**9) -> tuple[int, str]:
    """(exit code, stderr) of `elflow ARGS` in a fresh process whose address space is limited to `limit` bytes
    (RLIMIT_AS, as `prlimit --as` sets it): what that process may allocate, whatever the machine has."""
    import os
    import resource
    import subprocess
    import sys

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "elflow.cli", *map(str, args)], env=env, capture_output=True, text=True,
                       preexec_fn=limited, timeout=600, check=False)
    return r.returncode, r.stderr


def prepare_on_rank(rank: int, world: int, port: int, corpus: str, cache: str, log: str, out: str) -> None:
    """One rank of a Gloo group whose collectives time out after 2 s, reading a corpus whose preparation takes
    longer (SlowSpace); saves its training rows to `out`.<rank>."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from elflow.data.datasets import build_dataset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=2))
    try:
        train, _ = build_dataset(corpus, SlowSpace(4.0, log), 8, val_fraction=0.1, cache_dir=cache)
        torch.save(train.tokens, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@contextmanager
def small_tmpfs(folder: Path, size: str = "12m"):
    """A tmpfs of `size` mounted at `folder` (made here) for the block; skips the test with the reason where
    mounting is not allowed (it needs root)."""
    import os
    import subprocess

    folder.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({(r.stderr or r.stdout).strip() or 'mount failed'})")
    try:
        yield folder
    finally:
        os.sync()
        subprocess.run(["umount", "-l", str(folder)], check=False)


def full_disk(sd, path, *a, **k):
    """A stand-in for a checkpoint's save_file on a full disk: ENOSPC naming the file."""
    import errno

    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def fill(fs: Path, leave: int = 0) -> Path:
    """Take the free space of the file system of `fs` but `leave` bytes, in one file; returns it (delete it
    to free the space)."""
    import os

    st = os.statvfs(fs)
    free = st.f_bavail * st.f_frsize
    filler = fs / "filler"
    with open(filler, "wb") as f:
        if free - leave > 0:
            os.posix_fallocate(f.fileno(), 0, free - leave)
    return filler


def wandb_offline_runs(folder: Path) -> list[dict]:
    """What W&B wrote in offline mode under FOLDER/wandb, one dict per offline run in the order they ran:
    {"id", "history" (a list of {key: value} per logged step, "_step" included), "config", "summary"}, read from
    the run's .wandb file (a LevelDB-style log of wandb's protobuf records). W&B's service process writes the
    file on its own after `finish` returns: each file is read again until it holds the run's exit record."""
    import time

    runs = []
    for path in sorted((Path(folder) / "wandb").glob("offline-run-*/run-*.wandb")):
        for _ in range(600):
            run = _read_wandb_file(path)
            if run.pop("exited"):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"{path}: W&B wrote no exit record within a minute")
        runs.append(run)
    return runs


def _read_wandb_file(path: Path) -> dict:
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    def items(entries):
        return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) if i.value_json else None
                for i in entries}

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    run = {"id": path.stem[len("run-"):], "history": [], "config": {}, "summary": {}, "exited": False}
    pos, block, pending = 7, 32768, b""  # a 7-byte file header, then 32 KiB blocks of (crc, len, type) chunks
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):  # not yet a full record, nor the last chunk of one
            continue
        rec = pb.Record()
        rec.ParseFromString(pending)
        pending = b""
        what = rec.WhichOneof("record_type")
        if what == "history":
            run["history"].append(items(rec.history.item))
        elif what == "run":
            run["config"].update(items(rec.run.config.update))
        elif what == "config":
            run["config"].update(items(rec.config.update))
        elif what == "summary":
            run["summary"].update(items(rec.summary.update))
        elif what == "exit":
            run["exited"] = True
    return run


def elflow_to_official(sd: dict) -> dict:
    """elflow's state dict -> the authors' names and layouts: the inverse of runs.released.released_to_elflow,
    written out name by name so that the round trip checks the map."""
    import re

    from elflow.runs.released import TRANSPOSED

    inverse_t = {v: k for k, v in TRANSPOSED.items()}
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


def x_to_prediction(kind: str, x, z, t, noise_scale: float, t_eps: float):
    """The head output of target `kind` that stands for x at (z, t): the inverse of model.prediction_to_x."""
    from elflow.model import prediction_affine

    if kind == "x":
        return x
    a, b = prediction_affine(kind, t, noise_scale, t_eps)
    return (x - a * z) / b


# the document layout as in-memory id lists: the definition the token store's rows reproduce
def _fit(ids: list[int], length: int, eos_id: int) -> list[int]:
    """Truncate to length - 1 tokens + EOS (as HF truncation keeps the EOS); shorter ones stay as they are."""
    if not ids or ids[-1] != eos_id:
        ids = list(ids) + [eos_id]
    return ids if len(ids) <= length else list(ids[: length - 1]) + [eos_id]


def layout_documents(docs_ids: list[list[int]], length: int, pad_id: int, eos_id: int,
                     pad_in_loss: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per document: truncated or EOS-padded to `length`. Returns tokens, mask, attention_mask."""
    if not docs_ids:
        raise ELFError("no documents to lay out")
    n = len(docs_ids)
    tokens = torch.full((n, length), pad_id, dtype=torch.long)
    lengths = torch.empty(n, dtype=torch.long)
    for i, ids in enumerate(docs_ids):
        ids = _fit(ids, length, eos_id)
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths[i] = len(ids)
    real = torch.arange(length)[None, :] < lengths[:, None]  # (N, L)
    mask = torch.ones_like(real) if pad_in_loss else real.clone()
    return tokens, mask, real


def as_layout_1(doc: dict, train: dict | None = None, record: dict | None = None) -> dict:
    """A run.json or a checkpoint's state.json of today's layout, written as elflow wrote it before the run
    record: the record's parts at the top level ("train", "model", "space", "space_id", "method", "params",
    "short_run") and, in a checkpoint, the model's layout as "settings". A checkpoint of that layout held the
    run's record and training settings too: `record` and `train`, run.json's."""
    rec = doc.get("record", record)
    train = {k: v for k, v in doc.get("train", train).items() if k != "lr_schedule"}  # (stored from version 3 on)
    out = {k: v for k, v in doc.items() if k not in ("record", "format", "train", "version", "model_sha256")}
    if "step" in doc:
        out["format"] = "elflow-checkpoint-1"
    space = dict(rec["space"])
    space_id = space.pop("id", None)
    out.update(method=rec["method"], params=rec["params"], train=dict(train), model=rec["network"], space=space,
               space_id=space_id)
    if rec.get("options"):
        out["short_run"] = rec["options"]
    if "step" in doc:
        settings = {"length": rec["length"]}
        task = rec.get("task")
        if task:
            settings.update(source_length=task["source_length"], source_slot=task["source_slot"],
                            **({"task": task["name"]} if task.get("name") else {}))
        pd = rec.get("distillation")
        if pd:
            settings.update(distilled_steps=pd["student_steps"], teacher_steps=pd["teacher_steps"])
        out["settings"] = settings
    if isinstance(out.get("files"), dict):  # the sha256 of each file, without its size
        out["files"] = {k: v["sha256"] if isinstance(v, dict) else v for k, v in out["files"].items()}
    return out


def edit_record(run: Path, change) -> Path:
    """`run` with its run.json's record changed by `change` (a function of the record's dict, changed in place),
    and every checkpoint's state.json resealed to the changed record's digest where it reads as a record: the
    model as a crafted run would describe it, which the checkpoint then holds."""
    import json

    from elflow.runs.checkpoint import list_checkpoints, write_state
    from elflow.runs.record import RunRecord

    doc = json.loads((run / "run.json").read_text())
    change(doc["record"])
    (run / "run.json").write_text(json.dumps(doc))
    try:
        digest = RunRecord.from_dict(doc["record"]).digest()
    except (ELFError, ValueError, TypeError):
        return run  # a record that does not read: its reader refuses it before any checkpoint is compared
    for ck in list_checkpoints(run):
        state = json.loads((ck / "state.json").read_text())
        write_state(ck, {**state, "model_sha256": digest})
    return run


def readout_without_specials(folder, tokenizer_dir) -> None:
    """Every checkpoint under `folder` (a run or a student) made to never read out a special token (EOS, pad,
    unk) or one that decodes to blank ("▁"): a tiny random model may end every sample at once, which `sample` refuses as no result; this keeps its
    samples non-empty wherever the test is about something else. Each checkpoint is resealed (its sha256)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from elflow.runs.checkpoint import read_state, write_state
    from elflow.util.files import sha256_file

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = sorted(set(tok.all_special_ids) | {i for i in range(len(tok)) if not tok.decode([i]).strip()})
    for state in Path(folder).rglob("state.json"):
        ck = state.parent
        for name in ("ema.safetensors", "model.safetensors"):
            if (ck / name).is_file():
                weights = load_file(ck / name)
                bias = weights["decode_head.unembed.bias"].clone()
                bias[special] = -1e4
                weights["decode_head.unembed.bias"] = bias
                save_file(weights, ck / name)
        record = read_state(ck)
        for name, entry in record["files"].items():
            digest = sha256_file(ck / name)
            record["files"][name] = ({**entry, "sha256": digest, "bytes": (ck / name).stat().st_size}
                                     if isinstance(entry, dict) else digest)
        write_state(ck, record)


# ----------------------------------------------------------------------------------------------------------
# the command line in this process, and what it leaves on disk


def cli(capsys, args):
    """(exit code, stdout, stderr) of `elflow ARGS` run in this process (an argparse exit gives its code)."""
    from elflow.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def visible(err: str) -> list[str]:
    """The lines a terminal shows of `err`: of each line, what follows its last carriage return (a progress
    bar's redraws)."""
    return [line.split("\r")[-1] for line in err.split("\n")]


def one_error(code, err: str, command: str, *needles) -> str:
    """The command failed with exit 2 and one error line of its own, which starts a line of the terminal (not
    beside a progress bar) and holds every needle."""
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in visible(err) if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"elflow {command}: error: "), err
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def snapshot(root: Path) -> dict:
    """Every file under `root` (or `root` itself) with its bytes."""
    root = Path(root)
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def snapshot_with_folders(root: Path) -> dict:
    """Every file under `root`, hidden ones too, with its bytes (a folder's name maps to None)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


# ----------------------------------------------------------------------------------------------------------
# tiny runs and token stores


def tiny_flags(t5_dir, corpus, cache, **kw):
    """CLI flags of the run that `tiny_config` describes (test_train's tiny run)."""
    flags = {"preset": "tiny", "data": corpus, "space": f"t5:{t5_dir}", "length": 16, "batch": 4, "steps": 6,
             "warmup": 2, "ema-decay": 0.9, "log-every": 1, "ckpt-every": 3, "keep": 5, "dtype": "fp32", "seed": 1,
             "cache-dir": cache}
    flags.update(kw)
    return [x for k, v in flags.items() for x in (f"--{k}", v)] + ["--quiet"]


def assert_bit_identical(run_a: Path, run_b: Path, step: int):
    for a, b in zip(checkpoint_weights(run_a, step), checkpoint_weights(run_b, step)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def sampled_trajectory(run: Path) -> Path:
    """The trajectory the `trained_with_trajectory` fixture sampled beside `run`."""
    return run.parent / "s.trajectory.json"


def words(n: int, seed: int = 0) -> str:
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = np.array("the king of love sweet night lord heart well yes aside".split())
    return " ".join(rng.choice(vocab, n)) + "\n"


def train_args(data, out, space_flag, cache, *extra):
    return ["train", "--preset", "tiny", "--data", data, "--space", space_flag, "--length", "16", "--batch", "4",
            "--latent-std", "0.2", "--steps", "2", "--warmup", "0", "--ckpt-every", "1", "--dtype", "fp32",
            "--out", out, "--cache-dir",
            cache, "--quiet", *extra]


# ----------------------------------------------------------------------------------------------------------
# command lines and file trees of the fault tests


def make_fifo(path: Path) -> Path:
    """A fifo (named pipe) made at `path`, where nothing stands yet; returns the path."""
    import os

    os.mkfifo(path)
    return Path(path)


def dev_zero_link(path: Path) -> Path:
    """A symbolic link at `path` to /dev/zero, its own time the epoch (a lock of that age would be taken for a
    stale one); returns the path."""
    import os

    Path(path).symlink_to("/dev/zero")
    os.utime(path, (0, 0), follow_symlinks=False)
    return Path(path)


def tree_state(root: Path) -> dict:
    """Every entry under `root`, links and special files not followed: a regular file's bytes, a link's target,
    a device's or fifo's type and numbers."""
    import os
    import stat as st

    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            s = os.lstat(p)
            rel = str(p.relative_to(root))
            if st.S_ISLNK(s.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif st.S_ISREG(s.st_mode):
                out[rel] = ("file", p.read_bytes())
            elif st.S_ISDIR(s.st_mode):
                out[rel] = ("dir",)
            else:
                out[rel] = ("special", st.S_IFMT(s.st_mode), s.st_rdev)
    return out


def distill_args(teacher, out, cache, *extra):
    return ["distill", teacher, "--out", out, "--cache-dir", cache, "--quiet", "--dtype", "fp32", "--batch", "4",
            "--student-steps", "1", "--teacher-steps", "2", "--steps-per-round", "1", "--ckpt-every", "1", *extra]


def sample_args(run, out, *extra):
    return ["sample", run, "--num", "1", "--steps", "1", "--quiet", "--out", out, *extra]


def resume_args(run, cache, *extra):
    return ["train", "--resume", "--out", run, "--cache-dir", cache, "--quiet", *extra]


def new_run_args(t5, corpus, cache, out, **kw):
    return ["train", *tiny_flags(t5, corpus, cache, **kw), "--out", out]


TIMING = ("tokens_per_s", "elapsed")  # the fields of a metrics record that measure time


def untimed(path: Path) -> list[dict]:
    """The records of a metrics log without the fields that measure time."""
    import json

    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in path.read_text().splitlines()]


def corpus_of_words(tmp):
    (tmp / "c.txt").write_text(words(200))
    return tmp / "c.txt"


def vocabulary(space, n: int = 12) -> list[str]:
    """`n` words that the space's tokenizer reads as one token each, alone and in a row."""
    pieces = space.tokenizer.convert_ids_to_tokens(list(range(space.vocab_size)))
    words = sorted({p[1:] for p in pieces if p.startswith("\u2581") and p[1:].isalpha() and len(p) >= 3})
    one = [w for w in words if len(space.tokenize([f"{w} {w}"], eos=False)[0]) == 2]
    assert len(one) >= n, f"the tokenizer has {len(one)} one-token words"
    return one[:n]


# The fast suite runs a few cases of every class (FAST_DRAWS each, a fixed draw); the rest carry the slow mark, so
# that `python -m pytest -m slow` runs them all. ELFLOW_MATRIX_DRAWS=0 runs every case in the fast suite.
FAST_DRAWS = int(os.environ.get("ELFLOW_MATRIX_DRAWS", "2"))


def drawn(cases: list, class_of, ids=None) -> list:
    """`cases` (tuples of parameters) as pytest params: in each class (`class_of(case)`) FAST_DRAWS of them, drawn
    with a fixed seed, run in the fast suite and the others are marked slow (every case when FAST_DRAWS is 0);
    `ids` names each: a function of the case, or a list."""
    import random

    classes: dict = {}
    for i, case in enumerate(cases):
        classes.setdefault(class_of(case), []).append(i)
    rng, fast = random.Random(0), set()
    for members in classes.values():
        fast.update(members if FAST_DRAWS <= 0 else rng.sample(members, min(FAST_DRAWS, len(members))))
    return [pytest.param(*case, marks=() if i in fast else (pytest.mark.slow,),
                         id=ids[i] if isinstance(ids, list) else ids(case) if ids else None)
            for i, case in enumerate(cases)]


def built_from(sd: dict, config=None, options=None):
    """The network of elflow-named weights (its shape inferred from them unless `config` is given), the weights
    checked as every loader checks them (elflow.runs.checkpoint.load_weights)."""
    from elflow.model import build_network
    from elflow.runs.checkpoint import load_weights
    from elflow.runs.released import infer_config

    net = build_network(config or infer_config(sd, max_length=16), options)
    load_weights(net, sd, "the weights")
    return net
