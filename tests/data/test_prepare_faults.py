"""`prepare --overwrite` keeps the old store whole until the new one is complete (a bad source, a source that
changes while read), and a real full disk or read-only cache (a small tmpfs) is named as such."""
import subprocess

import pytest
from helpers import (
    CharSpace,
    assert_one_error,
    cli,
    corpus_of_words,
    fill,
    small_tmpfs,
    snapshot_with_folders,
    train_args,
    words,
)

from elflow.cli import main
from elflow.data.ingest import prepare_store
from elflow.data.origins import read_small_file
from elflow.util.errors import ELFError

# ----------------------------------------------------------------------------------------------------------
# prepare --overwrite keeps the old store whole until the new one is complete


def test_a_bad_source_during_overwrite_keeps_the_old_store_and_the_users_files(capsys, tmp_path, space_flag, store):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text(words(500))
    (mixed / "b.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    before = snapshot_with_folders(store)
    code, _, err = cli(capsys, ["prepare", mixed, "--space", space_flag, "--out", store, "--overwrite", "--quiet"])
    assert_one_error(code, err, "prepare", "b.txt is not valid UTF-8")
    assert snapshot_with_folders(store) == before


def test_a_source_that_changes_while_it_is_read_is_an_error_and_nothing_is_kept(tmp_path):
    src = tmp_path / "big.txt"
    src.write_text(words(20000))

    class Truncating(CharSpace):
        def tokenize(self, texts, eos=True):
            if self.calls == 0:
                with open(src, "r+b") as f:
                    f.truncate(1000)
            return super().tokenize(texts, eos)

    old = prepare_store(corpus_of_words(tmp_path), CharSpace(), tmp_path / "st", workers=1)
    (tmp_path / "st" / "mine.txt").write_text("keep")
    before = snapshot_with_folders(tmp_path / "st")
    with pytest.raises(ELFError, match=r"big.txt changed while it was read \([\d,]+ bytes when it was listed, 1,000 "
                                       r"now\); nothing of it was kept"):
        prepare_store(src, Truncating(), tmp_path / "st", chunk_bytes=4096, workers=1, overwrite=True)
    assert snapshot_with_folders(tmp_path / "st") == before and old.count == 1
    src.write_text(words(20000))
    with pytest.raises(ELFError, match="changed while it was read"):
        prepare_store(src, Truncating(), tmp_path / "fresh", chunk_bytes=4096, workers=1)
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(ELFError, match="grew past the 10 bytes it had when it was listed"):
        read_small_file(src, 10)


# ----------------------------------------------------------------------------------------------------------
# a real full disk: a small tmpfs (mounting needs root; skipped with the reason where it is not allowed)


@pytest.fixture
def small_store_fs(tmp_path):
    with small_tmpfs(tmp_path / "fs", "4m") as fs:
        yield fs


def test_a_full_disk_during_overwrite_keeps_the_old_store(capsys, tmp_path, space_flag, small_store_fs):
    st = small_store_fs / "st"
    (tmp_path / "small.txt").write_text(words(300))
    assert main(["prepare", str(tmp_path / "small.txt"), "--space", space_flag, "--out", str(st), "--quiet"]) == 0
    (st / "mine.txt").write_text("keep")
    before = snapshot_with_folders(st)
    (tmp_path / "big.txt").write_text(words(200000))  # about 1 MB of ids
    fill(small_store_fs, leave=64 << 10)
    code, _, err = cli(capsys, ["prepare", tmp_path / "big.txt", "--space", space_flag, "--out", st, "--overwrite",
                             "--workers", "1", "--quiet"])
    assert_one_error(code, err, "prepare", f"no space left on the device of {st}", f"the store in {st} was kept as it was")
    assert snapshot_with_folders(st) == before
    code, _, err = cli(capsys, ["prepare", tmp_path / "big.txt", "--space", space_flag, "--out", small_store_fs / "new",
                             "--quiet"])
    assert_one_error(code, err, "prepare", "no space left", f"nothing was kept: {small_store_fs / 'new'}, which this prepare had "
                                                     "made, was removed")
    assert not (small_store_fs / "new").exists()


def test_a_full_cache_is_named_as_the_cache(capsys, tmp_path, space_flag, small_store_fs):
    (tmp_path / "big.txt").write_text(words(200000))
    fill(small_store_fs, leave=64 << 10)
    code, _, err = cli(capsys, train_args(tmp_path / "big.txt", tmp_path / "run", space_flag, small_store_fs / "cache"))
    line = assert_one_error(code, err, "train", "no space left", "choose another cache folder than", "--cache-dir or "
                     "ELFLOW_CACHE")
    assert "--out" not in line and not (tmp_path / "run").exists()


def test_a_read_only_cache_is_one_line_naming_it(capsys, tmp_path, space_flag, small_store_fs):
    (small_store_fs / "cache").mkdir()
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_store_fs)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only ({r.stderr.strip()})")
    code, _, err = cli(capsys, train_args(corpus_of_words(tmp_path), tmp_path / "run", space_flag,
                                          small_store_fs / "cache"))
    assert_one_error(code, err, "train", f"the cache folder {small_store_fs / 'cache'} cannot be written (Read-only file system)",
              "--cache-dir or ELFLOW_CACHE")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_store_being_written_by_another_prepare_says_so(capsys, tmp_path, space_flag, overwrite):
    """A second prepare into a folder whose store another prepare is writing (its .prepare.lock held, only
    .partial files there): one line saying so, not 'already holds a token store; pass --overwrite', which
    would then be refused too; nothing changes."""
    from elflow.data.store_folder import LOCK, file_lock

    out = tmp_path / "store"
    corpus = tmp_path / "c.txt"
    corpus.write_text(words(200))
    holder = file_lock(out / LOCK)
    (out / "ids.partial").write_bytes(b"\0" * 8)
    before = snapshot_with_folders(out)
    try:
        code, _, err = cli(capsys, ["prepare", corpus, "--space", space_flag, "--out", out, "--quiet",
                                    *(["--overwrite"] if overwrite else [])])
    finally:
        holder.close()
    assert_one_error(code, err, "prepare", f"--out {out}: another elflow prepare is writing a token store there now")
    assert snapshot_with_folders(out) == before
