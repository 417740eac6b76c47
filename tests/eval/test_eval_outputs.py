"""What `elflow eval` and `elflow sweep` write and when: every output checked before any work (no link, device
or fifo; nothing among another run's files), an eval's samples and report written together at the end (a
refused, failed or stopped eval leaves none of them, and its rerun works), flags and inputs refused up front
with one line that says what the path is, and the one-line error printer."""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import assert_one_error, cli
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import elflow.cli.eval as eval_cli
from elflow.cli import main, one_line
from elflow.util.errors import ELFError


def paths_under(root: Path) -> list[str]:
    """The relative path of every file and folder under `root`, sorted."""
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))


@pytest.fixture(scope="module")
def base_and_other_runs(tmp_path_factory, tiny_t5_dir, tiny_corpus_file):
    """Two tiny runs (2 steps, a checkpoint at step 2): `base`, and `other`, a run whose folder outputs must
    not enter."""
    root = tmp_path_factory.mktemp("evalout")
    made = {}
    for name in ("base", "other"):
        made[name] = root / name
        assert main(["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space", f"t5:{tiny_t5_dir}",
                     "--latent-std", "1", "--length", "16", "--batch", "4", "--steps", "2", "--warmup", "1",
                     "--val-fraction", "0.3", "--dtype", "fp32", "--quiet", "--out", str(made[name]),
                     "--cache-dir", str(root / "cache")]) == 0
    return made, root / "cache"


def sample_argv(run, judge, cache, *extra):
    return ["eval", "--checkpoint", run, "--num", "4", "--steps", "2", "--judge", judge, "--device", "cpu",
            "--no-heldout", "--cache-dir", cache, *extra]


def assert_error_after_bars(code, err, command, *needles):
    """assert_one_error, once the progress bars drawn before the error (loading, sampling) are set aside."""
    bars = [line for line in err.splitlines() if "%|" in line and "error:" not in line]
    return assert_one_error(code, "\n".join(line for line in err.splitlines() if line not in bars), command, *needles)


def never(what):
    def called(*a, **k):
        raise AssertionError(f"{what} ran before the refusal")
    return called


# ----------------------------------------------------------------------------------------------------------
# outputs: checked before any work


def test_outputs_that_are_links_run_folders_or_inside_runs_are_refused_before_any_work(base_and_other_runs,
                                                                                      tiny_t5_judge_dir, tmp_path,
                                                                                      capsys, monkeypatch):
    made, cache = base_and_other_runs
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "dlink").symlink_to(outside)
    before = {name: paths_under(run) for name, run in made.items()}
    monkeypatch.setattr(eval_cli, "load_judge", never("the judge"))
    monkeypatch.setattr(eval_cli, "sample_and_score", never("sampling"))
    cases = [
        (["--out", tmp_path / "dlink"], "is a symbolic link"),
        (["--out", made["other"]], "is the folder of a run"),
        (["--out", made["other"] / "evals"], "the folder of a run"),
        (["--out", made["base"]], "is the folder of a run"),  # the evaluated run: only under its eval/
        (["--report", made["other"] / "report.json", "--out", tmp_path / "ev"], "lies inside"),
        (["--out", tmp_path / "ev", "--report", tmp_path / "ev" / "samples_seed0.jsonl"], "named twice"),
    ]
    for extra, says in cases:
        code, _, err = cli(capsys, sample_argv(made["base"], tiny_t5_judge_dir, cache, *extra))
        assert_one_error(code, err, "eval", says)
    # eval --task writes through the same checks, before it reads the pairs or the model
    monkeypatch.setattr(eval_cli, "load_for_sampling", never("reading the model"))
    code, _, err = cli(capsys, ["eval", "--task", tmp_path / "no-pairs.jsonl", "--checkpoint", made["base"], "--out",
                                tmp_path / "dlink"])
    assert_one_error(code, err, "eval", "--out", "is a symbolic link")
    assert paths_under(outside) == [] and {n: paths_under(r) for n, r in made.items()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dlink", "outside"]


def test_the_default_places_and_the_runs_own_eval_folder(base_and_other_runs, tiny_t5_judge_dir, tmp_path, capsys):
    """--checkpoint RUN writes into RUN/eval/SETTINGS, a checkpoint folder CKPT of it into RUN/eval/CKPT/SETTINGS
    (never into the checkpoint); --out under RUN/eval is allowed; a report among another run's files is not."""
    made, cache = base_and_other_runs
    run = tmp_path / "run"
    import shutil

    shutil.copytree(made["base"], run)
    tag = "sde_steps2_omega3_gamma1.5"
    assert cli(capsys, sample_argv(run, tiny_t5_judge_dir, cache))[0] == 0
    assert cli(capsys, sample_argv(run / "checkpoints" / "step_0000002", tiny_t5_judge_dir, cache))[0] == 0
    assert cli(capsys, sample_argv(run, tiny_t5_judge_dir, cache, "--out", run / "eval" / "mine"))[0] == 0
    assert paths_under(run / "eval") == sorted([
        "mine", "mine/report.json", "mine/samples_seed0.jsonl",
        tag, f"{tag}/report.json", f"{tag}/samples_seed0.jsonl",
        "step_0000002", f"step_0000002/{tag}", f"step_0000002/{tag}/report.json",
        f"step_0000002/{tag}/samples_seed0.jsonl"])
    assert sorted(p.name for p in (run / "checkpoints" / "step_0000002").iterdir()) == [
        "ema.safetensors", "model.safetensors", "optimizer.pt", "state.json", "state.sha256"]
    # samples of the run judged again: the report goes beside them by default; elsewhere in a run it is refused
    samples = run / "eval" / tag / "samples_seed0.jsonl"
    assert cli(capsys, ["eval", samples, "--judge", tiny_t5_judge_dir, "--device", "cpu", "--no-heldout"])[0] == 0
    assert samples.with_suffix(".eval.json").is_file()
    code, _, err = cli(capsys, ["eval", samples, "--judge", tiny_t5_judge_dir, "--report", made["other"] / "r.json"])
    assert_one_error(code, err, "eval", "--report", "lies inside", "choose another --report")


def _judge_that_fails(exc):
    def judge_score(*a, **k):
        def score(texts):
            raise exc
        return score
    return judge_score


@pytest.mark.parametrize("failure", [ELFError("the judge failed"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_an_eval_that_fails_after_sampling_leaves_nothing_and_its_rerun_works(base_and_other_runs, tiny_t5_judge_dir,
                                                                            tmp_path, capsys, monkeypatch, failure):
    made, cache = base_and_other_runs
    out = tmp_path / "ev"
    argv = sample_argv(made["base"], tiny_t5_judge_dir, cache, "--out", out, "--seeds", "0", "1", "--json")
    sampled = []
    real = eval_cli.sample_and_score
    monkeypatch.setattr(eval_cli, "sample_and_score", lambda *a, **k: sampled.append(1) or real(*a, **k))
    with monkeypatch.context() as m:
        m.setattr(eval_cli, "judge_score", _judge_that_fails(failure))
        code, _, err = cli(capsys, argv)
    assert sampled and code == (2 if isinstance(failure, ELFError) else 130)
    assert "nothing of this eval was written" in err or "the judge failed" in err
    assert not out.exists()  # no samples file to block the rerun, no empty folder
    code, stdout, err = cli(capsys, argv)
    assert code == 0, err
    assert paths_under(out) == ["report.json", "samples_seed0.jsonl", "samples_seed1.jsonl"]
    assert json.loads(stdout)["num_seeds"] == 2


def test_a_model_that_gives_only_empty_texts_is_one_line_and_writes_nothing(base_and_other_runs, tiny_t5_judge_dir,
                                                                           tmp_path, capsys):
    """The EMA readout made to say EOS first at every position (the checkpoint resealed): every sample is empty;
    eval says so, writes nothing, with or without MAUVE; sweep says so and names the samples it kept."""
    import shutil

    from transformers import AutoTokenizer

    from elflow.runs.checkpoint import read_state, write_state
    from elflow.util.files import sha256_file

    made, cache = base_and_other_runs
    run = tmp_path / "eos"
    shutil.copytree(made["base"], run)
    ck = run / "checkpoints" / "step_0000002"
    ema = load_file(ck / "ema.safetensors")
    eos = AutoTokenizer.from_pretrained(tiny_t5_judge_dir).eos_token_id
    ema["decode_head.unembed.weight"] = torch.zeros_like(ema["decode_head.unembed.weight"])
    bias = torch.zeros_like(ema["decode_head.unembed.bias"])
    bias[eos] = 100.0
    ema["decode_head.unembed.bias"] = bias
    save_file(ema, ck / "ema.safetensors")
    state = read_state(ck)
    state["files"]["ema.safetensors"] = sha256_file(ck / "ema.safetensors")
    write_state(ck, state)
    refs = tmp_path / "refs.txt"
    refs.write_text("\n".join(f"line {i} of real text" for i in range(12)) + "\n")
    for extra in ([], ["--mauve", "--references", refs, "--num", "12"]):
        code, _, err = cli(capsys, sample_argv(run, tiny_t5_judge_dir, cache, *extra))
        assert_error_after_bars(code, err, "eval", "gives only empty texts", "nothing is written")
        assert not (run / "eval").exists()
    code, _, err = cli(capsys, ["sweep", run, "--omega", "1", "--steps", "2", "--sampler", "ode", "--num", "3",
                                "--judge", tiny_t5_judge_dir, "--device", "cpu", "--out", tmp_path / "sw"])
    assert_error_after_bars(code, err, "sweep", "gives only empty texts", "the samples are in")


# ----------------------------------------------------------------------------------------------------------
# flags and inputs: refused up front, saying what the path is


def test_flags_are_refused_before_the_model_is_sampled(base_and_other_runs, tiny_t5_judge_dir, tmp_path, capsys,
                                                        monkeypatch):
    made, cache = base_and_other_runs
    monkeypatch.setattr(eval_cli, "load_judge", never("the judge"))
    monkeypatch.setattr(eval_cli, "sample_and_score", never("sampling"))
    for extra, says in [(["--seeds", "1", "1"], "--seeds names seed 1 more than once"),
                        (["--max-length", "-5"], "--max-length must be an integer >= 1"),
                        (["--max-length", "0"], "--max-length must be an integer >= 1"),
                        (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
                        (["--num", "0"], "--num must be an integer from 1 to 10,000,000"),
                        (["--mauve"], "MAUVE with 2 clusters needs at least 10 texts a side, got 4 and 4")]:
        code, _, err = cli(capsys, sample_argv(made["base"], tiny_t5_judge_dir, cache, "--out", tmp_path / "ev",
                                               *extra))
        assert_one_error(code, err, "eval", says)
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"text": "a b c"}\n')
    code, _, err = cli(capsys, ["eval", samples, "--judge", "no-judge", "--max-length", "-5"])
    assert_one_error(code, err, "eval", "--max-length")
    # the sweep: before any cell is sampled
    import elflow.experiments.sweep as sweep_lib

    monkeypatch.setattr(sweep_lib, "load_for_sampling", never("reading the model"))
    for flag in ("--batch-size", "--gen-batch-size"):
        code, _, err = cli(capsys, ["sweep", made["base"], "--omega", "1", "--steps", "2", "--sampler", "ode",
                                    "--num", "4", flag, "0", "--out", tmp_path / "sw"])
        assert_one_error(code, err, "sweep", f"{flag} must be an integer >= 1, got 0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder", "missing", "empty", "blank-jsonl", "blank-lines"])
def test_references_that_hold_no_text_are_named_before_any_judging(tmp_path, capsys, kind, base_and_other_runs,
                                                                    monkeypatch):
    made, _ = base_and_other_runs
    refs = {"dev-zero": Path("/dev/zero"), "fifo": tmp_path / "fifo", "folder": tmp_path / "refs",
            "missing": tmp_path / "missing.txt", "empty": tmp_path / "empty.txt",
            "blank-jsonl": tmp_path / "blank.jsonl", "blank-lines": tmp_path / "blank.txt"}[kind]
    if kind == "fifo":
        os.mkfifo(refs)
    elif kind == "folder":
        refs.mkdir()
    elif kind == "empty":
        refs.write_text("")
    elif kind == "blank-jsonl":
        refs.write_text('{"text": ""}\n{"text": "   "}\n')
    elif kind == "blank-lines":
        refs.write_text("\n  \n\n")
    says = {"dev-zero": "is a character device, not a regular file", "fifo": "is a fifo, not a regular file",
            "folder": "is a folder, not a regular file", "missing": "does not exist", "empty": "holds no text",
            "blank-jsonl": "holds no text", "blank-lines": "holds no text"}[kind]
    samples = tmp_path / "s.jsonl"
    samples.write_text("".join(json.dumps({"text": f"sample {i} text"}) + "\n" for i in range(20)))
    monkeypatch.setattr(eval_cli, "load_judge", never("the judge"))
    code, _, err = cli(capsys, ["eval", samples, "--mauve", "--references", refs, "--judge", "no-judge"])
    assert_one_error(code, err, "eval", str(refs), says)
    code, _, err = cli(capsys, ["sweep", made["base"], "--omega", "1", "--steps", "2", "--sampler", "ode", "--num",
                                "4", "--mauve", "--references", refs, "--out", tmp_path / "sw"])
    assert_one_error(code, err, "sweep", str(refs), says)
    assert not (tmp_path / "sw").exists() and not samples.with_suffix(".eval.json").exists()


@pytest.mark.parametrize("kind", ["fifo", "folder", "dev-zero"])
def test_a_samples_file_that_is_not_a_file_says_what_it_is(tmp_path, capsys, kind):
    path = {"fifo": tmp_path / "s.jsonl", "folder": tmp_path, "dev-zero": Path("/dev/zero")}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    code, _, err = cli(capsys, ["eval", path, "--judge", "no-judge", "--report", tmp_path / "r.json"])
    assert_one_error(code, err, "eval", str(path), {"fifo": "is a fifo", "folder": "is a folder",
                                                   "dev-zero": "is a character device"}[kind])


def test_identical_degenerate_sets_score_one_through_eval(tiny_t5_judge_dir, tmp_path, capsys):
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps({"text": "The king of the night."}) + "\n" for _ in range(20)))
    code, stdout, err = cli(capsys, ["eval", same, "--mauve", "--references", same, "--judge", tiny_t5_judge_dir,
                                     "--device", "cpu", "--no-heldout", "--json"])
    assert code == 0, err
    assert json.loads(stdout)["mauve"] == 1.0


# ----------------------------------------------------------------------------------------------------------
# the error printer


def test_an_error_naming_a_path_with_a_newline_is_one_line_for_every_command(base_and_other_runs, tmp_path, capsys):
    odd = tmp_path / "nl\nname\x1b[31m.jsonl"
    odd.write_text("{}\n")
    code, _, err = cli(capsys, ["sample", base_and_other_runs[0]["base"], "--out", odd])
    assert "nl\\nname\\x1b[31m.jsonl already exists" in assert_one_error(code, err, "sample")
    for argv, command in [
                          (["eval", tmp_path / "s\nx.jsonl", "--judge", "no-judge"], "eval"),
                          (["view", odd, "--out", tmp_path / "p.html"], "view"),
                          (["sweep", tmp_path / "r\nun", "--plot-only", "--out", tmp_path / "w\u2028x"], "sweep")]:
        code, _, err = cli(capsys, argv)
        line = assert_one_error(code, err, command)
        assert "\x1b" not in line and "\u2028" not in line


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_one_line_escapes_what_would_break_the_line_and_keeps_the_rest(text):
    line = one_line(text)
    assert len(line.splitlines()) <= 1 and "\x1b" not in line and "\u202e" not in line
    if all(c.isprintable() or c == " " for c in text):
        assert line == text
