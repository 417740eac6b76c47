"""What the terminal shows besides results: a source cut at sampling warned once with its count, an empty
--wandb on resume said once, train-encoder skipping a Latin-1 file, an error under an open progress bar on a
line of its own."""
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from helpers import cli, one_error, visible

from elflow.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


@pytest.fixture
def every_warning():
    """Python's own once-per-location filter off: what is shown once is the CLI's doing (one text once per
    command), in a process that runs many commands."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        yield


def test_a_source_cut_at_sampling_is_warned_once_with_the_count(capsys, tmp_path, fixed_slot, every_warning):
    long = "the king of love and the lord of night and good sweet heart"  # 12 words
    code, _, err = cli(capsys, ["sample", fixed_slot, "--source", long, "--steps", "1", "--quiet", "--out",
                                tmp_path / "one.jsonl"])
    assert code == 0, err
    [w] = _warnings(err)
    assert re.fullmatch(r"warning: 1 of 1 source is longer than the 4 source tokens this model was trained with and "
                        r"was cut to 4 \((\d+) of (\d+) tokens dropped\)", w), w
    dropped, total = map(int, re.search(r"\((\d+) of (\d+)", w).groups())
    assert total >= 12 and dropped == total - 4
    # several batches and several seeds: still one warning
    src = tmp_path / "src.jsonl"
    rows = [{"input": long if i % 2 else "the king", "output": "x"} for i in range(5)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = cli(capsys, ["sample", fixed_slot, "--source", src, "--batch", "2", "--steps", "1", "--quiet",
                                "--out", tmp_path / "five.jsonl"])
    assert code == 0, err
    [w] = _warnings(err)
    assert w.startswith("warning: 2 of 5 sources are longer than the 4 source tokens") and "were cut to 4" in w
    code, _, err = cli(capsys, ["eval", "--task", src, "--checkpoint", fixed_slot, "--steps", "1", "--batch", "2",
                                "--seeds", "0", "1", "--out", tmp_path / "ev", "--json"])
    assert code == 0, err
    [w] = _warnings(err)
    assert w.startswith("warning: 2 of 5 sources are longer")
    # sources that fit: no warning
    code, _, err = cli(capsys, ["sample", fixed_slot, "--source", "the king", "--steps", "1", "--quiet", "--out",
                                tmp_path / "short.jsonl"])
    assert code == 0 and not _warnings(err), err


def test_an_empty_wandb_on_resume_turns_logging_off_and_says_so(capsys, tmp_path, trained_with_trajectory):
    run = tmp_path / "run"
    shutil.copytree(trained_with_trajectory, run)
    code, _, err = cli(capsys, ["train", "--out", run, "--resume", "--steps", "7", "--wandb", ""])
    assert code == 0, err
    assert "note: --wandb '': W&B logging is off for this run from here on" in err
    assert json.loads((run / "run.json").read_text())["train"]["wandb"] == ""


def test_train_encoder_skips_a_latin_1_file_with_on_bad_skip(capsys, tmp_path, tiny_corpus_file):
    data = tmp_path / "mixed"
    data.mkdir()
    shutil.copy(tiny_corpus_file, data / "a.txt")
    (data / "b.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    code, _, err = cli(capsys, ["train-encoder", "--data", data, "--on-bad", "skip", "--vocab", "100", "--steps", "1",
                                "--hidden", "32", "--quiet", "--out", tmp_path / "enc"])
    assert code == 0, err
    assert "b.txt is not valid UTF-8" in err and (tmp_path / "enc" / "config.json").exists()


def test_an_error_under_an_open_progress_bar_starts_its_own_line(capsys, monkeypatch):
    """Any command: the bar is ended before the one line (and a warning is written above the bar)."""
    import types
    import warnings

    import elflow.cli as cli_module
    from elflow.util.errors import ELFError

    def run(args):
        from tqdm.auto import tqdm

        bar = tqdm(total=10, desc="work", file=sys.stderr)
        bar.update(3)
        warnings.warn("half way")
        raise ELFError("it broke")

    monkeypatch.setattr(cli_module, "_load", lambda name: types.SimpleNamespace(run=run, add_arguments=lambda p: None))
    code = main(["toy"])
    err = capsys.readouterr().err
    lines = visible(err)
    assert code == 2 and "elflow toy: error: it broke" in lines, err
    assert [line for line in lines if "warning: half way" in line] == ["warning: half way"], err
    assert err.endswith("elflow toy: error: it broke\n")  # the bar is not drawn again after the error


def test_sample_to_a_full_standard_output_says_what_it_wrote(tmp_path, trained):
    """Standard output on /dev/full: the samples are written, and the one line says so and why the texts were not
    printed (not "no space left on device; free some space", which sent the user to rerun into an --out that
    now exists); no second complaint at exit."""
    import os
    import subprocess

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    out = tmp_path / "s.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "elflow.cli", "sample", str(trained), "--num", "2", "--steps", "1",
                            "--out", str(out)], stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=600)
    line = one_error(r.returncode, r.stderr, "sample")  # (beside the progress bar's lines)
    assert line == (f"elflow sample: error: wrote 2 samples to {out}, but standard output cannot be written (No "
                    "space left on device), so the texts were not printed; --quiet prints none"), line
    assert "Exception ignored" not in r.stderr
    assert len(out.read_text().splitlines()) == 2


class _GoneReader:
    """A standard output whose reader has gone (a pipe into `head` that exited): writing fails, flushing with
    nothing written does not."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


@pytest.mark.parametrize("stdout", [None, _GoneReader()], ids=["closed", "reader-gone"])
def test_sample_with_standard_output_closed_or_its_reader_gone_writes_quietly(capsys, tmp_path, trained, monkeypatch,
                                                                             stdout):
    out = tmp_path / "s.jsonl"
    monkeypatch.setattr(sys, "stdout", stdout)
    code, _, err = cli(capsys, ["sample", trained, "--num", "2", "--steps", "1", "--out", out])
    assert code == 0 and "error" not in err and visible(err)[-2:] == [f"wrote 2 samples to {out}", ""], err
    assert len(out.read_text().splitlines()) == 2


def test_a_reader_that_goes_away_ends_the_command_quietly(monkeypatch, capsys):
    """`elflow train --print-config | head -1`: when standard output's reader has gone, writing raises
    BrokenPipeError; the command ends with exit 0 and no error line (as `sample` does)."""
    import io

    from elflow.cli import main

    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise io.UnsupportedOperation("no descriptor")

    monkeypatch.setattr("sys.stdout", Gone())
    assert main(["train", "--preset", "tiny", "--print-config"]) == 0
    assert "error" not in capsys.readouterr().err
