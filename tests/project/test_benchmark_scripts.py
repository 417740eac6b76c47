"""The documented benchmark scripts follow the CLI's rules: every bad number any of their flags can take, generated
from their own parsers, is one line `SCRIPT: error: ...` and exit 2 before any stage starts; bad outputs, a past
deadline and a teacher that is no conditional model likewise."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = ("few_step_cond", "few_step_text")
INT_BAD = ("0", "-1", "1000000000000", "nan", "inf")
FLOAT_BAD = ("0", "-1", "nan", "inf", "1e12")
# what a script accepts, and why it is not bad input there (every other value above is refused)
ACCEPTED = {
    "--seeds": {"0"}, "--probe-seeds": {"0"},  # seed 0 is a seed
    "--teacher-full-steps": {"0"},  # 0: the teacher's own step count is not scored
    "--ema-decay": {"0"},  # no averaging
    "--guidance": {"0"}, "--probe-guidance": {"0"},  # no source guidance
    "--lr": {"1e12"},  # any positive rate: a step this large diverges, which the stage says in one line
    "--deadline": {"1e12"},  # a unix time still to come
}


def script(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def number_flags(name: str) -> list[tuple[str, str]]:
    """(flag, bad value) for every int and float flag of the script's parser."""
    cases = []
    for action in script(name).build_parser()._actions:
        if action.type in (int, float) and action.option_strings:
            flag = action.option_strings[0]
            cases += [(flag, v) for v in (INT_BAD if action.type is int else FLOAT_BAD)
                      if v not in ACCEPTED.get(flag, ())]
    return cases


CASES = [(name, flag, value) for name in SCRIPTS for flag, value in number_flags(name)]


@pytest.fixture
def no_stage(monkeypatch):
    """Fail the test if a script gets past its argument checks into its stages."""
    def started(*a, **k):
        raise AssertionError("a stage started")

    monkeypatch.setattr(script("few_step_cond"), "run", started)
    monkeypatch.setattr(script("few_step_text"), "run_stages", started)


def refused(capsys, name: str, argv: list[str]) -> str:
    try:
        code = script(name).main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert lines[0].startswith(f"{name}: error: "), lines[0]
    return lines[0]


def test_the_parsers_have_number_flags_to_try():
    assert {flag for name, flag, _ in CASES} >= {"--seeds", "--lr", "--num", "--batch", "--eval-steps", "--deadline"}


@pytest.mark.parametrize("name, flag, value", CASES, ids=[f"{n}{f}={v}" for n, f, v in CASES])
def test_a_bad_number_is_one_line_before_any_stage(capsys, no_stage, name, flag, value):
    line = refused(capsys, name, [flag, value])
    assert flag in line or "invalid" in line, line


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_output_that_is_a_file_or_unwritable_is_one_line_before_any_stage(capsys, no_stage, tmp_path, name):
    a_file = tmp_path / "corpus.txt"
    a_file.write_text("x")
    assert "--out" in refused(capsys, name, ["--out", str(a_file)])
    assert "--results" in refused(capsys, name, ["--results", str(a_file)])
    assert "--copy-png" in refused(capsys, name, ["--copy-png", str(tmp_path)])  # a folder where a file goes


def test_a_teacher_that_is_no_conditional_model_is_one_line_before_any_stage(capsys, no_stage, tmp_path):
    run = tmp_path / "run"
    assert "holds no elflow run" in refused(capsys, "few_step_cond", ["--teacher", str(run)])
    record2 = Path(__file__).resolve().parents[1] / "fixtures" / "record2" / "elf"
    assert "is not a conditional model" in refused(capsys, "few_step_cond", ["--teacher", str(record2)])


def test_every_accepted_value_is_a_real_flag_of_a_script():
    flags = {action.option_strings[0] for name in SCRIPTS for action in script(name).build_parser()._actions
             if action.option_strings}
    assert set(ACCEPTED) <= flags, set(ACCEPTED) - flags
    assert all(isinstance(script(name).build_parser(), argparse.ArgumentParser) for name in SCRIPTS)


def test_the_gpu_benchmark_s_cpu_dry_run_passes_every_stage(tmp_path):
    """`python benchmarks/gpu.py --dry-run`, the command a GPU session runs first at tiny sizes on the CPU: every
    stage ends with its figures, none with an error (its exactness stage broke once on a draw field of None)."""
    import json
    import os
    import subprocess

    out = tmp_path / "dry.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(BENCHMARKS.parent / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert '"error"' not in text, text[:2000]
    result = json.loads(text)
    assert result["exactness"]["loss_rel_diff"] == 0.0
