"""A file elflow keeps as its own (a folder's lock, a run's files, a sweep's CSV, a W&B run's id) is read by the
bounded reader and written by the one writer: a symbolic link (out of the folder, to /dev/zero, dangling), a
fifo or a folder in its place is one ELFError naming it, at once: never followed, never waited on, never read
without bound, and left as it was."""

import os
import signal
import stat
from pathlib import Path

import pytest
from helpers import dev_zero_link, make_fifo

from elflow.util.errors import ELFError
from elflow.util.files import FolderLock, check_own, not_own, own_folder, read_own_text, sha256_file


@pytest.fixture(autouse=True)
def no_hang():
    """A read that blocks (a fifo opened for reading waits for a writer) fails the test instead of hanging."""

    def stop(*_):
        raise TimeoutError("blocked on a file: a fifo was opened without O_NONBLOCK")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# what stands at a path instead of a regular file of elflow's own: make(path) -> the words that name it


def _put_fifo(path: Path) -> str:
    make_fifo(path)
    return "a fifo"


def _put_dev_zero_link(path: Path) -> str:
    dev_zero_link(path)
    return "symbolic link (to /dev/zero)"


def _put_link_outside(path: Path) -> str:
    outside = path.parent.parent / f"outside-{path.name}"
    outside.write_text('{"pid": 1, "host": "elsewhere", "command": "x"}\n')
    path.symlink_to(outside)
    return f"symbolic link (to {outside})"


def _put_dangling_link(path: Path) -> str:
    path.symlink_to(path.parent / "nowhere")
    return "symbolic link"


def _put_folder(path: Path) -> str:
    path.mkdir()
    return "a folder"


KINDS = {"fifo": _put_fifo, "link-dev-zero": _put_dev_zero_link, "link-outside": _put_link_outside,
         "dangling-link": _put_dangling_link, "folder": _put_folder}


def _left_as_it_was(path: Path, before: os.stat_result) -> None:
    after = os.lstat(path)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))


@pytest.fixture
def folder(tmp_path) -> Path:
    f = tmp_path / "run"
    f.mkdir()
    return f


@pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())
def test_a_lock_that_is_no_regular_file_is_refused_at_once_and_kept(folder, make):
    lock = folder / FolderLock.NAME
    kind = make(lock)
    before = os.lstat(lock)
    with pytest.raises(ELFError) as e:
        FolderLock(folder, "elflow train").acquire()
    assert str(lock) in str(e.value) and kind in str(e.value) and "refused" in str(e.value)
    assert "move it away" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ELFError, match="refused"):
        FolderLock.text(folder)
    _left_as_it_was(lock, before)


def test_the_lock_text_is_read_as_the_lock_holder_wrote_it(folder):
    assert FolderLock.text(folder) is None
    with FolderLock(folder, "elflow train") as held:
        text = FolderLock.text(folder)
        assert f'"pid": {held.info["pid"]}' in text and text.endswith("\n")
    assert FolderLock.text(folder) is None


@pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())
def test_an_own_text_file_is_read_only_as_a_regular_file(folder, make):
    path = folder / "sweep.csv"
    make(path)
    before = os.lstat(path)
    with pytest.raises(ELFError, match="refused") as e:
        read_own_text(path, 1 << 20, "the sweep's results")
    assert str(path) in str(e.value) and "move it away" in str(e.value)
    _left_as_it_was(path, before)


def test_an_own_text_file_is_read_within_its_bound(folder):
    path = folder / "f.txt"
    path.write_text("é\n")
    assert read_own_text(path, 3) == "é\n"
    with pytest.raises(ELFError, match="more than the 2 "):
        read_own_text(path, 2)
    path.write_bytes(b"\xff\n")
    with pytest.raises(ELFError, match="corrupted .not UTF-8"):
        read_own_text(path, 10)


@pytest.mark.parametrize("name, folder_wanted, make, says", [
    ("metrics.jsonl", False, make_fifo, "a fifo"),
    ("report.json", False, _put_link_outside, "symbolic link"),
    ("samples.jsonl", False, _put_folder, "a folder"),
    ("tb", True, _put_link_outside, "symbolic link"),
    ("wandb", True, lambda p: p.write_text("") or "a file", "a file"),
])
def test_check_own_names_what_stands_where_elflow_keeps_its_own(folder, name, folder_wanted, make, says):
    path = folder / name
    make(path)
    with pytest.raises(ELFError) as e:
        check_own(path, f"the run's {name}", folder=folder_wanted)
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value) and f"the run's {name}" in str(e.value)
    assert ("never through links" in str(e.value)) == (says == "symbolic link")  # named only for a link


def test_nothing_or_the_right_kind_passes(folder):
    (folder / "f").write_text("")
    (folder / "d").mkdir()
    assert not_own(folder / "missing") is None and not_own(folder / "f") is None
    assert not_own(folder / "d", folder=True) is None and not_own(folder / "missing", folder=True) is None
    assert not_own(folder / "d") == "a folder" and not_own(folder / "f", folder=True) == "a file"


def test_an_own_folder_is_made_and_never_a_link(folder, tmp_path):
    made = own_folder(folder / "tb", "the run's TensorBoard files")
    assert made.is_dir() and not made.is_symlink()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (folder / "wandb").symlink_to(outside)
    with pytest.raises(ELFError, match="symbolic link .* refused"):
        own_folder(folder / "wandb", "the run's W&B files")
    assert list(outside.iterdir()) == []


def test_a_hash_is_never_read_from_a_fifo_or_through_an_own_link(folder):
    make_fifo(folder / "weights")
    with pytest.raises(ELFError, match="a fifo"):
        sha256_file(folder / "weights")
    (folder / "real").write_bytes(b"abc")
    (folder / "link").symlink_to(folder / "real")
    assert sha256_file(folder / "link") == sha256_file(folder / "real")
    with pytest.raises(ELFError, match="symbolic link"):
        sha256_file(folder / "link", own=True)


@pytest.mark.parametrize("make", [make_fifo, dev_zero_link, _put_link_outside],
                         ids=["fifo", "link-dev-zero", "link-outside"])
def test_a_sweep_csv_that_is_not_the_sweeps_own_is_refused(folder, make):
    from elflow.experiments.sweep import read_csv

    make(folder / "sweep.csv")
    with pytest.raises(ELFError, match="sweep.csv .the sweep's results.: .*refused"):
        read_csv(folder / "sweep.csv")


def test_a_corrupted_number_in_a_sweep_csv_is_one_line_naming_it(folder):
    from elflow.experiments.sweep import read_csv, write_csv

    write_csv(folder / "sweep.csv", [{"sampler": "ode", "steps": 4, "gen_ppl": 12.5}])
    assert read_csv(folder / "sweep.csv")[0]["steps"] == 4
    text = (folder / "sweep.csv").read_text().replace(",4,", ",four,")
    (folder / "sweep.csv").write_text(text)
    with pytest.raises(ELFError) as e:
        read_csv(folder / "sweep.csv")
    assert "sweep.csv line 2: steps is 'four', not a number" in str(e.value) and "\n" not in str(e.value)


def test_a_w_and_b_id_that_is_not_the_runs_own_is_refused_and_a_garbled_one_is_none(folder, monkeypatch):
    from elflow.runs.tracking import ID_FILE, _stored, wandb_dir

    make_fifo(folder / ID_FILE)
    with pytest.raises(ELFError, match="a fifo where elflow keeps the id of the run's W&B run"):
        _stored(folder, "p")
    os.unlink(folder / ID_FILE)
    (folder / ID_FILE).write_text("{not json")
    assert _stored(folder, "p") is None
    monkeypatch.delenv("WANDB_DIR", raising=False)
    (folder / "wandb").symlink_to(folder.parent)
    with pytest.raises(ELFError, match="wandb: a symbolic link .* the run's W&B files; refused"):
        wandb_dir(folder)


def test_the_one_reader_refuses_what_it_cannot_read_with_what_to_do(folder):
    from elflow.util import jsonio

    make_fifo(folder / "state.json")
    with pytest.raises(ELFError, match="a fifo, not a regular file; refused .*: move it away, then run again"):
        jsonio.read_json(folder / "state.json", own=True)
    with pytest.raises(ELFError, match="a fifo, not a regular file; refused: pass a regular file"):
        jsonio.read_json(folder / "state.json")
    with pytest.raises(ELFError, match="a fifo"):
        jsonio.open_regular(folder / "state.json")
