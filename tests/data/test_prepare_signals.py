"""Signals and dying workers: `elflow prepare` stops cleanly on SIGTERM and SIGINT and says what became of
the folder, its workers neither print nor outlive it, SIGKILL's half-done replacement is undone by the next
open, and a worker killed ends prepare in seconds with one line and no child left."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CharSpace

from elflow.cli import main
from elflow.data.reading import TextFiles
from elflow.data.store import TokenStore

ROOT = Path(__file__).resolve().parents[2]


from pathlib import Path

from helpers import snapshot_with_folders, words

NEST = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
BIGINT = '{"text": 1' + "0" * 5000 + "}\n"


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
    before = snapshot_with_folders(store)
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
    assert snapshot_with_folders(store) == before and not (tmp_path / "new").exists()
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
    before = snapshot_with_folders(store)
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
    assert snapshot_with_folders(store) == before and _gone(workers)


def test_sigkill_of_prepare_kills_its_workers_and_the_next_open_undoes_the_replacement(tmp_path, store, capsys):
    before = snapshot_with_folders(store)
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
    assert {k: v for k, v in snapshot_with_folders(store).items() if not k.startswith(".prepare")} == before
    capsys.readouterr()
    opened = TokenStore(store)
    assert "removed the unfinished new store" in capsys.readouterr().err
    assert opened.count == 20 and snapshot_with_folders(store) == before


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
# a prepare worker that dies


def _children(pid: int) -> set:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("then", ["nothing", "sigterm"])
def test_a_worker_killed_ends_prepare_in_seconds_with_one_line_and_no_child(tmp_path, then):
    out, log = tmp_path / "st", tmp_path / "calls.log"
    proc = _slow_prepare(tmp_path, out, log, "--workers", "2", delay=0.2)
    try:
        workers = _workers_of(proc, log)
        victim = min(workers)
        t = time.time()
        os.kill(victim, signal.SIGKILL)  # what the OOM killer does
        if then == "sigterm":
            time.sleep(0.2)
            os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        took = time.time() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 20 and _gone(workers) and not _children(proc.pid)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    if lines[0].startswith("elflow prepare: error: "):
        assert lines[0].startswith(f"elflow prepare: error: a prepare worker process (pid {victim}) died (killed "
                                   "by SIGKILL"), lines[0]
        # a SIGTERM that comes once the command has said so ends it at once
        assert proc.returncode in ((2, -signal.SIGTERM) if then == "sigterm" else (2,)), err
    else:  # SIGTERM came first
        assert then == "sigterm" and proc.returncode == 128 + signal.SIGTERM, err
        assert lines[0].startswith("elflow prepare: stopped by SIGTERM"), lines[0]
    assert not out.exists()  # the partial store went with it
