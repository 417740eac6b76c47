"""Sources and arguments `elflow prepare` and `train --data` refuse before anything is written (table-driven):
devices, fifos, links, missing fields, worker counts; a link to a device beside good files is skipped."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_one_error, cli, corpus_of_words, make_fifo, train_args, words

from elflow.data.store import TokenStore

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------------
# sources and arguments refused before anything is written: table-driven


def _fifo_source(tmp):
    return make_fifo(tmp / "fifo.txt")


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


SOURCE_CASES = [
    # (id, source maker, extra flags, words of the one line)
    ("dev-zero", lambda tmp: "/dev/zero", [], ["/dev/zero is a character device, not a regular file"]),
    ("fifo", _fifo_source, [], ["fifo.txt is a fifo, not a regular file"]),
    ("folder-of-a-link-to-dev-zero", _link_folder, [],
     ["holds no .txt files it can read",
      "skipped, not regular files: a.txt (a link to /dev/zero, a character device)"]),
    ("workers-above-the-cores", corpus_of_words, ["--workers", "10000"],
     ["--workers 10000 is more than the", "pass at most"]),
    ("workers-0", corpus_of_words, ["--workers", "0"], ["--workers must be at least 1"]),
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
                                         (_fifo_source, "is a fifo"), (_link_folder, "holds no .txt files it can read")],
                         ids=["dev-zero", "fifo", "folder-of-a-link-to-dev-zero"])
def test_train_data_that_is_not_a_regular_file_is_one_line(capsys, tmp_path, space_flag, make, needle):
    code, _, err = cli(capsys, train_args(make(tmp_path), tmp_path / "run", space_flag, tmp_path / "cache"))
    assert_one_error(code, err, "train", needle)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache" / "stores").exists()


def test_a_link_to_a_device_beside_good_files_is_skipped_with_a_warning(capsys, tmp_path, space_flag):
    folder = _link_folder(tmp_path)
    (folder / "b.txt").write_text(words(50))
    code, _, err = cli(capsys, ["prepare", folder, "--space", space_flag, "--out", tmp_path / "out", "--quiet"])
    assert code == 0, err
    assert f"warning: skipping {folder / 'a.txt'}: a link to /dev/zero, a character device, not a regular file" in err
    assert TokenStore(tmp_path / "out").count == 1
