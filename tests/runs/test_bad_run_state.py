"""Bad run state, seeds, sizes and encodings, table-driven: each is one line (exit 2, no traceback) and changes
nothing under the test folder (no half-made run folder either)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_one_error,
    cli,
    cli_under_memory_limit,
    distill_args,
    drawn,
    edit_record,
    new_run_args,
    resume_args,
    sample_args,
    tree_state,
)
from safetensors.torch import load_file

from elflow.runs.checkpoint import list_checkpoints, write_state

# ----------------------------------------------------------------------------------------------------------
# bad run state, seeds, sizes, encodings: table-driven. Each is one line (exit 2, no traceback) and changes
# nothing under the test folder (no half-made run folder either).


def _rewrite_state(run: Path, change) -> Path:
    """Every checkpoint of `run` with its state.json changed by `change` (state.sha256 written to match)."""
    for ck in list_checkpoints(run):
        state = json.loads((ck / "state.json").read_text())
        write_state(ck, change(state))
    return run


def _set(d: dict, keys: str, value) -> dict:
    *path, last = keys.split(".")
    inner = d
    for k in path:
        inner = inner[k]
    inner[last] = value
    return d


def _without(d: dict, keys: str) -> dict:
    """`d` with the field at the dotted path `keys` removed."""
    *path, last = keys.split(".")
    inner = d
    for k in path:
        inner = inner[k]
    del inner[last]
    return d


def _edit_json(path: Path, keys: str, value) -> None:
    path.write_text(json.dumps(_set(json.loads(path.read_text()), keys, value)))


def _rehash_files(ck: Path) -> None:
    from elflow.util.files import sha256_file

    state = json.loads((ck / "state.json").read_text())
    state["files"] = {name: {"sha256": sha256_file(ck / name), "bytes": (ck / name).stat().st_size}
                      for name in state["files"]}
    write_state(ck, state)


def _reshaped(run: Path) -> Path:
    """The newest checkpoint's weights replaced by those of another shape (one matrix cut in half)."""
    from safetensors.torch import save_file

    ck = list_checkpoints(run)[-1]
    for name in ("model.safetensors", "ema.safetensors"):
        sd = load_file(ck / name)
        key = next(k for k, v in sd.items() if v.dim() == 2)
        sd[key] = sd[key][: sd[key].shape[0] // 2].contiguous()
        save_file(sd, ck / name)
    for old in list_checkpoints(run)[:-1]:
        shutil.rmtree(old)
    _rehash_files(ck)
    return run


class Payload:
    """A pickle that, if it were ever unpickled, would write `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def _pickled_optimizer(run: Path) -> Path:
    for ck in list_checkpoints(run):
        torch.save({"optimizer": Payload(run.parent / "PWNED")}, ck / "optimizer.pt")
        _rehash_files(ck)
    return run


def _edited_optimizer(run: Path, change) -> Path:
    """Every checkpoint of `run` with its optimiser states (optimizer.pt's list) changed by `change`, resealed."""
    for ck in list_checkpoints(run):
        blob = torch.load(ck / "optimizer.pt", weights_only=True)
        change(blob["optimizer"])
        torch.save(blob, ck / "optimizer.pt")
        _rehash_files(ck)
    return run


def _edited_ema(run: Path, change) -> Path:
    """Every checkpoint of `run` with its EMA weights changed by `change` (the dict of tensors), resealed."""
    from safetensors.torch import save_file

    for ck in list_checkpoints(run):
        sd = load_file(ck / "ema.safetensors")
        change(sd)
        save_file(sd, ck / "ema.safetensors")
        _rehash_files(ck)
    return run


def _one_value(sd: dict, value: float) -> None:
    """The last entry of the largest weight set to `value`."""
    sd[max(sd, key=lambda k: sd[k].numel())].view(-1)[-1] = value


def _oblong_matrix(states) -> dict:
    """The stored state of the first Muon matrix that is not square."""
    return next(s for s in states[0]["state"].values() if s["m"].ndim == 2 and s["m"].shape[0] != s["m"].shape[1])


def _pickled_judge(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2,
                                                    "n_positions": 16}))
    torch.save({"transformer.wte.weight": Payload(folder.parent / "PWNED")}, folder / "pytorch_model.bin")
    return folder


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# (id, command, setup(tmp, run, t5, corpus, cache) -> argv, words of the error)
STATE_CASES = [
    ("train-seed-beyond-int64", "train", lambda t, r, t5, c, k: ["train", "--seed", "5000000000", "--print-config"],
     ["--seed must be an integer from 0 to 4294967295", "5000000000"]),
    ("sample-seed-beyond-the-generator", "sample",
     lambda t, r, t5, c, k: sample_args(r, t / "s.jsonl", "--seed", "200000000000000"), ["--seed must be an integer"]),
    ("sample-seed-2-to-the-70", "sample", lambda t, r, t5, c, k: sample_args(r, t / "s.jsonl", "--seed", 2**70),
     ["--seed must be an integer"]),
    ("train-space-seed-negative", "train",
     lambda t, r, t5, c, k: ["train", "--space-seed", "-1", "--print-config"], ["--space-seed must be an integer"]),
    ("train-depth-a-billion", "train", lambda t, r, t5, c, k: new_run_args(t5, c, k, t / "new", depth=10**9),
     ["depth 1000000000", "needs", "more than the", "of memory"]),
    ("train-hidden-a-million", "train", lambda t, r, t5, c, k: new_run_args(t5, c, k, t / "new", hidden=10**6),
     ["hidden 1000000", "more than the"]),
    ("train-space-dim-huge", "train",
     lambda t, r, t5, c, k: new_run_args(t5, c, k, t / "new", space=f"random-table:{t5}", **{"space-dim": 10**8}),
     ["x 100000000 vectors", "more than the", "--space-dim"]),
    ("sample-record-depth-huge", "sample",
     lambda t, r, t5, c, k: sample_args(edit_record(r, lambda d: _set(d, "network.depth", 10**9)), t / "s.jsonl"),
     ["depth 1000000000", "more than the"]),
    ("sample-record-depth-negative", "sample",
     lambda t, r, t5, c, k: sample_args(edit_record(r, lambda d: _set(d, "network.depth", -5)), t / "s.jsonl"),
     ["depth must be an integer from 1 to", "-5"]),
    ("sample-record-depth-text", "sample",
     lambda t, r, t5, c, k: sample_args(edit_record(r, lambda d: _set(d, "network.depth", "abc")), t / "s.jsonl"),
     ["run.json", "cannot be read"]),
    ("sample-state-a-list", "sample",
     lambda t, r, t5, c, k: sample_args(_rewrite_state(r, lambda s: [1, 2]), t / "s.jsonl"),
     ["none of its checkpoints can be read", "a JSON object was expected, found array"]),
    ("sample-record-without-network-predict", "sample",
     lambda t, r, t5, c, k: sample_args(edit_record(r, lambda d: _without(d, "network.predict")),
                                        t / "s.jsonl"), ["'network.predict'", "lacks"]),
    ("sample-record-without-recipe-noise-scale", "sample",
     lambda t, r, t5, c, k: sample_args(edit_record(r, lambda d: _without(d, "recipe.noise_scale")),
                                        t / "s.jsonl"), ["'recipe.noise_scale'", "lacks"]),
    ("sample-record-sampling-steps-huge", "sample",
     lambda t, r, t5, c, k: sample_args(edit_record(r, lambda d: _set(d, "sampling.steps", 100000)),
                                        t / "s.jsonl"), ["field 'sampling'", "100000"]),
    ("eval-checkpoint-state-a-list", "eval",
     lambda t, r, t5, c, k: ["eval", "--checkpoint", _rewrite_state(r, lambda s: [1, 2]), "--out", t / "ev",
                             "--judge", t / "no-judge", "--num", "1"], ["a JSON object was expected"]),
    ("distill-state-a-list", "distill",
     lambda t, r, t5, c, k: distill_args(_rewrite_state(r, lambda s: [1, 2]), t / "d", k),
     ["a JSON object was expected"]),
    ("init-from-state-a-list", "train",
     lambda t, r, t5, c, k: new_run_args(t5, c, k, t / "new", **{"init-from": _rewrite_state(r, lambda s: [1, 2])}),
     ["a JSON object was expected"]),
    ("sweep-state-a-list", "sweep",
     lambda t, r, t5, c, k: ["sweep", _rewrite_state(r, lambda s: [1, 2]), "--out", t / "sw", "--judge",
                             t / "no-judge", "--num", "1", "--steps", "1"], ["a JSON object was expected"]),
    ("resume-run-json-train-a-list", "train",
     lambda t, r, t5, c, k: ((r / "run.json").write_text('{"train": []}'), resume_args(r, k))[-1],
     ["run.json", "\"train\" must be a JSON object"]),
    ("resume-run-json-batch-text", "train",
     lambda t, r, t5, c, k: (_edit_json(r / "run.json", "train.batch", "four"), resume_args(r, k))[-1],
     ["run.json: its setting 'batch' must be an integer from 1 to", "'four'"]),
    ("quickstart-report-only-run-json-garbage", "quickstart",
     lambda t, r, t5, c, k: ((r / "run.json").write_text("garbage"), ["quickstart", "--report-only", "--out", r])[-1],
     ["run.json: corrupted or truncated"]),
    ("quickstart-report-only-run-json-empty", "quickstart",
     lambda t, r, t5, c, k: ((r / "run.json").write_text(""), ["quickstart", "--report-only", "--out", r])[-1],
     ["run.json: corrupted or truncated"]),
    ("resume-a-checkpoint-of-another-shape", "train", lambda t, r, t5, c, k: resume_args(_reshaped(r), k, "--steps", "8"),
     ["does not fit this run", "size mismatch"]),
    ("resume-a-pickled-optimizer", "train",
     lambda t, r, t5, c, k: resume_args(_pickled_optimizer(r), k, "--steps", "8"),
     ["optimizer.pt: cannot be read with weights_only=True", "never unpickles"]),
    ("sample-an-ema-weight-nan", "sample",
     lambda t, r, t5, c, k: sample_args(_edited_ema(r, lambda sd: _one_value(sd, float("nan"))), t / "s.jsonl"),
     ["step_0000006: weight ", "holds NaN or infinite values; the model cannot sample"]),
    ("sample-an-ema-weight-minus-inf", "sample",
     lambda t, r, t5, c, k: sample_args(_edited_ema(r, lambda sd: _one_value(sd, -float("inf"))), t / "s.jsonl"),
     ["step_0000006: weight ", "holds NaN or infinite values; the model cannot sample"]),
    ("resume-an-optimizer-state-with-a-nan-momentum", "train",
     lambda t, r, t5, c, k: resume_args(_edited_optimizer(r, lambda s: s[0]["state"][0]["m"].fill_(float("nan"))),
                                        k, "--steps", "8"),
     ["step_0000006/optimizer.pt: parameter ", "momentum 'm' holds NaN or infinite values", "--init-from"]),
    ("resume-an-optimizer-state-with-a-transposed-momentum", "train",
     lambda t, r, t5, c, k: resume_args(_edited_optimizer(
         r, lambda s: _oblong_matrix(s).update(m=_oblong_matrix(s)["m"].t().contiguous())), k, "--steps", "8"),
     ["step_0000006/optimizer.pt: parameter ", "momentum 'm' has shape", "the parameter's is"]),
    ("resume-an-optimizer-state-without-its-momentum", "train",
     lambda t, r, t5, c, k: resume_args(_edited_optimizer(r, lambda s: s[0]["state"][1].pop("m")), k, "--steps", "8"),
     ["step_0000006/optimizer.pt: parameter ", "its state holds no momentum 'm'"]),
    ("resume-an-optimizer-state-with-a-negative-step", "train",
     lambda t, r, t5, c, k: resume_args(_edited_optimizer(r, lambda s: s[0]["state"][0]["step"].fill_(-5)), k,
                                        "--steps", "8"),
     ["step_0000006/optimizer.pt: parameter ", "step count is -5.0, not a whole number from 0 to 6"]),
    ("resume-an-optimizer-state-whose-group-is-no-longer-muon", "train",
     lambda t, r, t5, c, k: resume_args(_edited_optimizer(r, lambda s: s[0]["param_groups"][0].update(muon=False)),
                                        k, "--steps", "8"),
     ["step_0000006/optimizer.pt: group 1 has muon False, this run's update has True"]),
    ("resume-every-checkpoint-unusable", "train",
     lambda t, r, t5, c, k: ([(ck / "optimizer.pt").unlink() for ck in list_checkpoints(r)],
                             resume_args(r, k, "--steps", "8"))[-1],
     ["no checkpoint can be resumed", "step_0000006/optimizer.pt: missing", "step_0000003/optimizer.pt: missing",
      "nothing was changed"]),
    ("resume-steps-already-passed", "train", lambda t, r, t5, c, k: resume_args(r, k, "--steps", "5"),
     ["already at step 6, past --steps 5", "nothing was changed"]),
    ("resume-run-json-data-edited", "train",
     lambda t, r, t5, c, k: (_edit_json(r / "run.json", "train.data", "/etc/passwd"), resume_args(r, k, "--steps", "8"))[-1],
     ["--data /etc/passwd is not the data this run was trained on", "state.json records"]),
    ("sample-checkpoint-without-state-json", "sample",
     lambda t, r, t5, c, k: ((r / "checkpoints" / "step_0000006" / "state.json").unlink(),
                             sample_args(r / "checkpoints" / "step_0000006", t / "s.jsonl"))[-1],
     ["incomplete elflow checkpoint folder (no state.json)"]),
    ("eval-samples-latin-1", "eval",
     lambda t, r, t5, c, k: ["eval", _write(t / "l.jsonl", b'{"text": "caf\xe9"}\n'), "--judge", t / "no-judge"],
     ["l.jsonl line 1: not UTF-8 text", "0xe9"]),
    ("eval-samples-binary", "eval",
     lambda t, r, t5, c, k: ["eval", _write(t / "b.jsonl", bytes(range(256))), "--judge", t / "no-judge"],
     ["b.jsonl line 1: not valid JSON (a NUL character at offset 0: binary data?)"]),
    ("eval-judge-with-pickled-weights", "eval",
     lambda t, r, t5, c, k: ["eval", _write(t / "s.jsonl", b'{"text": "a b"}\n'), "--judge", _pickled_judge(t / "pj")],
     ["does not hold a loadable causal LM", "pickled weights are never loaded"]),
    ("train-out-empty", "train", lambda t, r, t5, c, k: new_run_args(t5, c, k, ""), ["argument --out: an empty value"]),
    ("sample-out-empty", "sample", lambda t, r, t5, c, k: sample_args(r, ""), ["argument --out: an empty value"]),
    ("train-out-through-a-missing-folder", "train",
     lambda t, r, t5, c, k: new_run_args(t5, c, k, f"{t}/nonexist/../x"), ["goes through", "nonexist", "does not exist"]),
    ("sample-omega-negative", "sample", lambda t, r, t5, c, k: sample_args(r, t / "s.jsonl", "--omega", "-1"),
     ["omega must be a number from 0 to 100"]),
    ("sample-length-beyond-memory", "sample",
     lambda t, r, t5, c, k: sample_args(r, t / "s.jsonl", "--length", "10000000"),
     ["--length 10000000", "needs", "more than the", "a shorter --length"]),
]


SLOW_STATE_CASES = {"sample-length-beyond-memory"}  # (it sizes a 10-million-position sampling)


# two cases of each command in the fast suite (helpers.drawn), every case under -m slow
@pytest.mark.parametrize("command,setup,needles", [
    p if c[0] not in SLOW_STATE_CASES else pytest.param(*c[1:], id=c[0], marks=pytest.mark.slow)
    for c, p in zip(STATE_CASES, drawn([c[1:] for c in STATE_CASES], lambda case: case[0],
                                       [c[0] for c in STATE_CASES]))])
def test_bad_run_state_seeds_sizes_and_encodings_are_one_line(capsys, tmp_path, trained, tiny_t5_dir,
                                                               tiny_corpus_file, cache, monkeypatch, command, setup,
                                                               needles):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "t"
    shutil.copytree(trained, run)
    argv = setup(tmp_path, run, tiny_t5_dir, tiny_corpus_file, cache)
    before, cached = tree_state(tmp_path), sorted(p.name for p in Path(cache).rglob("*"))
    code, _, err = cli(capsys, argv)
    said = [line for line in err.splitlines() if not line.startswith("warning: --length")]  # (past the trained L)
    assert_one_error(code, "\n".join(said), command, *needles)
    assert tree_state(tmp_path) == before
    assert sorted(p.name for p in Path(cache).rglob("*")) == cached  # nothing read into the cache either
    assert not (tmp_path / "PWNED").exists()  # no pickle ever ran


def test_a_stored_network_past_the_process_memory_limit_is_one_line(run_copy, tmp_path):
    """A record whose vocab_size is 10^8 (a 12 GiB network) sampled under a 6 GB address-space limit, on a machine
    with more memory than that: refused against the process's own limit, before anything is allocated (not an
    allocator's traceback)."""
    run = edit_record(run_copy, lambda d: _set(d, "network.vocab_size", 10**8))
    before = tree_state(tmp_path)
    code, err = cli_under_memory_limit(sample_args(run, tmp_path / "s.jsonl"))
    assert_one_error(code, err, "sample", "the network at depth 2, hidden 64, heads 4, dim 32, vocab_size 100000000",
                     "needs about 12.3 GiB (weights 12.3 GiB)", "left under this process's memory limit (ulimit)",
                     "check the stored config")
    assert tree_state(tmp_path) == before
