"""Bad arguments to every command, refused before any work: one clear line on stderr (exit 2), no traceback,
nothing written; `--device cuda` without CUDA; a figure's --out that exists, is read-only or lies under a file."""
import errno

import pytest
from helpers import assert_one_error, cli

from elflow.util import files

# ----------------------------------------------------------------------------------------------------------
# argument checks (no work done): table-driven


CASES = [
    # (id, command line, words the error must contain)
    ("train-lr-negative", ["train", "--lr", "-1", "--print-config"], ["--lr must be a number > 0", "-1"]),
    ("quickstart-task-alone", ["quickstart", "--task", "shuffle"], ["--task belongs to the conditional", "--conditional"]),
    ("quickstart-steps-0", ["quickstart", "--conditional", "--steps", "0"], ["--steps must be an integer from 1 to 100,000,000"]),
    ("train-lr-nan", ["train", "--lr", "nan", "--print-config"], ["--lr must be a number > 0", "nan"]),
    ("train-ema-above-1", ["train", "--ema-decay", "1.5", "--print-config"], ["--ema-decay", "[0, 1)"]),
    ("train-length-0", ["train", "--length", "0", "--print-config"], ["--length must be an integer from 1 to 1,048,576"]),
    ("train-val-fraction-1", ["train", "--val-fraction", "1", "--print-config"], ["--val-fraction"]),
    ("train-depth-0", ["train", "--depth", "0", "--print-config"], ["--depth must be an integer from 1 to"]),
    ("train-decode-clean-1", ["train", "--decode-clean-prob", "1", "--print-config"], ["--decode-clean-prob", "[0, 1)"]),
    ("train-table-readout-neg", ["train", "--table-readout", "-1", "--print-config"], ["--table-readout", ">= 0"]),
    ("train-source-slot-alone", ["train", "--source-slot", "fixed", "--print-config"],
     ["--source-slot lays out (source, target) pairs; give --source-length too"]),
    ("train-source-length-0", ["train", "--source-length", "0", "--print-config"], ["--source-length must be", ">= 1"]),
    ("train-sample-steps-0", ["train", "--sample-steps", "0", "--print-config"],
     ["--sample-steps must be an integer from 1 to 10,000"]),
    ("train-sample-omega-nan", ["train", "--sample-omega", "nan", "--print-config"], ["--sample-omega", "nan"]),
    ("toy-gamma-negative", ["toy", "--gamma", "-1", "--sampler", "sde"], ["--gamma", "from 0 to 100"]),
    ("toy-gamma-nan", ["toy", "--gamma", "nan", "--sampler", "sde"], ["--gamma", "nan"]),
    ("schedules-samples-0", ["schedules", "--samples", "0"], ["--samples must be at least 2"]),
    ("judge-context-1", ["train-judge", "--context", "1"], ["--context must be at least 2"]),
]


@pytest.mark.parametrize("args,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_arguments_are_one_line(capsys, tmp_path, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)  # any output would land here
    code, _, err = cli(capsys, args)
    assert_one_error(code, err, args[0], *needles)
    assert list(tmp_path.iterdir()) == []  # nothing written


DEVICE_CASES = [
    ["train", "--device", "cuda", "--preset", "tiny"],
    ["sample", "RUN", "--device", "cuda"],
    ["eval", "SAMPLES", "--device", "cuda"],
    ["bench", "forward", "--preset", "tiny", "--device", "cuda"],
]


@pytest.mark.parametrize("args", DEVICE_CASES, ids=[a[0] for a in DEVICE_CASES])
def test_cuda_without_cuda(capsys, tmp_path, no_cuda, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"text": "a b c"}\n')
    args = [str(samples) if a == "SAMPLES" else str(tmp_path / "nothing") if a == "RUN" else a for a in args]
    code, _, err = cli(capsys, args)
    assert_one_error(code, err, args[0], "CUDA is not available")


OUT_CASES = [  # commands whose --out is a file: (args before --out)
    ["toy", "--steps", "1", "--num", "2"],
    ["schedules", "--samples", "1000"],
]


@pytest.mark.parametrize("args", OUT_CASES, ids=[a[0] for a in OUT_CASES])
def test_existing_output_is_kept(capsys, tmp_path, args):
    out = tmp_path / "figure.png"
    out.write_bytes(b"precious")
    code, _, err = cli(capsys, args + ["--out", out])
    assert_one_error(code, err, args[0], "already exists", "--overwrite")
    assert out.read_bytes() == b"precious"
    code, _, err = cli(capsys, args + ["--out", out, "--overwrite"])
    assert code == 0, err
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("args", OUT_CASES, ids=[a[0] for a in OUT_CASES])
def test_read_only_output(capsys, tmp_path, read_only, args):
    code, _, err = cli(capsys, args + ["--out", tmp_path / "x.png"])
    assert_one_error(code, err, args[0], "cannot write", "Read-only file system")
    assert list(tmp_path.iterdir()) == []


def test_train_out_is_a_file_under_a_file_or_read_only(capsys, tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("keep me")
    code, _, err = cli(capsys, ["train", "--preset", "tiny", "--out", f])
    assert_one_error(code, err, "train", "is a file, not a folder")
    code, _, err = cli(capsys, ["train", "--preset", "tiny", "--out", f / "run"])
    assert_one_error(code, err, "train", "lies under", "which is a file")
    assert f.read_text() == "keep me"

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(files, "probe_writable", refuse)
    code, _, err = cli(capsys, ["train", "--preset", "tiny", "--out", tmp_path / "ro" / "run"])
    assert_one_error(code, err, "train", "cannot write", "Read-only file system")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
