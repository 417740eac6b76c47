"""Shared test fixtures, defined here once for every folder of tests/ (plain helpers are in helpers.py). Tests
run offline: the hub is switched off before anything imports it."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core (pyproject's -n): each computes on one thread,
    os.environ["OMP_NUM_THREADS"] = "1"  # its child processes too, so that the workers never oversubscribe
    os.environ["MKL_NUM_THREADS"] = "1"

try:  # run from a checkout without `pip install -e .`
    import elflow  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import pytest

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three love night king lord sweet heart"
).split()


def tiny_corpus_text(n_sentences: int = 300, seed: int = 0) -> str:
    """A few kilobytes of deterministic lowercase English-like text."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ".", ",", "?", "!"]))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def tiny_t5_dir(tmp_path_factory) -> Path:
    """A tiny random T5 encoder + a sentencepiece tokenizer trained on a few KB, saved like a hub folder.

    T5 conventions: pad 0, EOS 1, unk 2, and 100 extra ids on top of the 200 sentencepiece pieces, so
    len(tokenizer) = 300 while the model's table has 320 rows (as t5-small has 32,128 rows for 32,100 tokens).
    """
    import sentencepiece as spm
    import torch
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    folder = tmp_path_factory.mktemp("tiny_t5")
    train_txt = folder / "train.txt"
    train_txt.write_text(tiny_corpus_text())
    spm.SentencePieceTrainer.train(
        input=str(train_txt), model_prefix=str(folder / "spiece"), vocab_size=200, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0, minloglevel=2,
    )
    train_txt.unlink()
    # transformers 5 ignores T5Tokenizer(vocab_file=...): load the sentencepiece model from the folder.
    tokenizer = T5Tokenizer.from_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    torch.manual_seed(0)
    config = T5Config(d_model=32, d_kv=16, num_layers=2, num_heads=2, d_ff=64, vocab_size=320,
                      dropout_rate=0.1, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    model = T5EncoderModel(config)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_t5_judge_dir(tmp_path_factory, tiny_t5_dir) -> Path:
    """A tiny causal LM over the tiny T5 tokenizer, saved as a judge folder."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("judge")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=320, n_positions=64, bos_token_id=1,
                               eos_token_id=1)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_t5_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_corpus") / "corpus.txt"
    path.write_text(tiny_corpus_text(400, seed=1))
    return path



# ----------------------------------------------------------------------------------------------------------
# a tiny trained run, shared by the tests of one module (each module trains its own)


@pytest.fixture(scope="session")
def trained_once(tmp_path_factory, tiny_t5_dir, tiny_corpus_file) -> Path:
    """The tiny run `trained` copies, trained once per test process: ROOT/run and the cache it prepared its
    store in, ROOT/cache."""
    from helpers import tiny_config

    from elflow.train import train

    root = tmp_path_factory.mktemp("trained_once")
    train(tiny_config(tiny_t5_dir, tiny_corpus_file), root / "run", cache_dir=root / "cache", quiet=True)
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory, trained_once) -> Path:
    """A module's own cache, holding the store `trained` was prepared from (as if the module had trained it)."""
    folder = tmp_path_factory.mktemp("cache")
    shutil.copytree(trained_once / "cache", folder, dirs_exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory, trained_once, cache) -> Path:
    """An uninterrupted 6-step run of the tiny preset with checkpoints at steps 3 and 6: a module's own copy of
    the one run trained for the test process (training is deterministic: the copy is the run it would train)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    shutil.copytree(trained_once / "run", run)
    return run


@pytest.fixture(scope="module")
def trained_with_trajectory(trained) -> Path:
    """`trained`, with a trajectory sampled from it beside the run (helpers.sampled_trajectory finds it)."""
    from elflow.cli import main

    traj = trained.parent / "s.jsonl"
    assert main(["sample", str(trained), "--num", "2", "--steps", "3", "--trajectory", "--quiet", "--out",
                 str(traj)]) == 0
    return trained


@pytest.fixture(scope="module")
def teacher_run(request, tmp_path_factory, tiny_t5_dir, tiny_corpus_file) -> tuple[Path, Path]:
    """(run, cache): a tiny ELF run to distil, trained once per module: `tiny_config`'s run with the settings of
    the module's TEACHER_RUN dict on top (its steps, warm-up, checkpoints), e.g. TEACHER_RUN = dict(steps=2)."""
    from helpers import tiny_config

    from elflow.train import train

    root = tmp_path_factory.mktemp("teacher")
    settings = getattr(request.module, "TEACHER_RUN", {})
    train(tiny_config(tiny_t5_dir, tiny_corpus_file, **settings), root / "run", cache_dir=root / "cache", quiet=True)
    return root / "run", root / "cache"


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst


@pytest.fixture(scope="module")
def fixed_slot(tmp_path_factory, tiny_t5_dir, cache) -> Path:
    """A conditional run in the fixed source slot, sources of up to 4 tokens, rows of 16."""
    from helpers import tiny_config

    from elflow.train import train

    folder = tmp_path_factory.mktemp("fixed")
    rng = random.Random(0)
    words = "the king of love and sweet night lord good heart".split()
    pairs = folder / "pairs.jsonl"
    with open(pairs, "w") as f:
        for _ in range(64):
            s = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
            f.write(json.dumps({"input": s, "output": s}) + "\n")
    run = folder / "run"
    cfg = tiny_config(tiny_t5_dir, pairs, task={"source_length": 4, "source_slot": "fixed"}, steps=2, ckpt_every=2)
    train(cfg, run, cache_dir=cache, quiet=True)
    return run


# ----------------------------------------------------------------------------------------------------------
# token stores


@pytest.fixture(scope="module")
def space_flag(tiny_t5_dir) -> str:
    return f"t5:{tiny_t5_dir}"


@pytest.fixture
def store(tmp_path, space_flag, capsys) -> Path:
    """A text store of 20 documents (prepared from a .jsonl), with a file of the user's beside it."""
    from helpers import words

    from elflow.cli import main

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": words(30, i)}) + "\n" for i in range(20)))
    out = tmp_path / "st"
    assert main(["prepare", str(src), "--space", space_flag, "--out", str(out), "--quiet"]) == 0
    (out / "mine.txt").write_text("keep")
    capsys.readouterr()
    return out


@pytest.fixture
def text_store(tmp_path, space_flag, capsys) -> Path:
    """A text store of 20 documents prepared from a .jsonl."""
    from helpers import cli, words

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": words(30, i)}) + "\n" for i in range(20)))
    out = tmp_path / "st"
    code, _, err = cli(capsys, ["prepare", src, "--space", space_flag, "--out", out, "--quiet"])
    assert code == 0, err
    return out


@pytest.fixture
def pair_store(tmp_path, space_flag, capsys) -> Path:
    from helpers import words

    from elflow.cli import main

    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"input": words(6, i), "output": words(4, 100 + i)}) + "\n" for i in range(12)))
    out = tmp_path / "ps"
    assert main(["prepare", str(src), "--space", space_flag, "--out", str(out), "--source-length", "8",
                 "--quiet"]) == 0
    capsys.readouterr()
    return out


# ----------------------------------------------------------------------------------------------------------
# faults


@pytest.fixture
def read_only(monkeypatch):
    """Make every write probe fail as on a read-only file system."""
    from elflow.util import files

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(files, "probe_writable", refuse)


@pytest.fixture
def no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def small_fs(tmp_path):
    """A 12 MB tmpfs (mounting needs root; the test skips with the reason where it is not allowed)."""
    from helpers import small_tmpfs

    with small_tmpfs(tmp_path / "fs") as fs:
        yield fs


@pytest.fixture
def live_process():
    """A process that stays alive for the test (a lock holder)."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield holder
    holder.kill()
    holder.wait()


def pytest_sessionfinish(session, exitstatus):
    """Under ELFLOW_STRICT_SKIPS=1 (CI), a test skipped because its data is missing fails the run."""
    if os.environ.get("ELFLOW_STRICT_SKIPS") != "1":
        return
    from helpers import MISSING_DATA

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reasons = [rep.longrepr[2] for rep in (reporter.stats.get("skipped", []) if reporter else [])
               if isinstance(rep.longrepr, tuple) and MISSING_DATA in rep.longrepr[2]]
    if reasons:
        for reason in sorted(set(reasons)):
            print(f"\nELFLOW_STRICT_SKIPS: a test was skipped for missing data: {reason}")
        session.exitstatus = 1


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes run fastest on one thread (and a busy machine's spare threads only spin)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
