"""Loading a model to sample goes one way and reads each file once: the record once, each weight file it uses
once (checked on the bytes read), never the optimiser state, and none of the training code."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# run in a fresh interpreter: which files it opens (Python's audit hook sees every open) and which elflow
# modules it imported, as JSON on stdout
PROBE = r"""
import json, os, sys
opened, watching = [], [False]

def hook(event, args):
    if watching[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened.append(os.fsdecode(args[0]))

sys.addaudithook(hook)
if len(sys.argv) > 2:  # `elflow sample RUN ...` into the file sys.argv[2] (the CLI's parsers import every command's)
    from elflow.cli import main
    watching[0] = True
    assert main(["sample", sys.argv[1], "--num", "1", "--steps", "2", "--quiet", "--out", sys.argv[2]]) == 0
else:
    from elflow.runs.load import load_for_sampling
    watching[0] = True
    net, space = load_for_sampling(sys.argv[1], device="cpu")
watching[0] = False
print(json.dumps({"opened": opened, "modules": sorted(m for m in sys.modules if m.startswith("elflow"))}))
"""


def probe(path: Path, *more: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(path), *more], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def reads_in(seen: dict, ckpt: Path) -> dict:
    """How often each file of the checkpoint folder was opened."""
    names = [Path(p).name for p in seen["opened"] if Path(p).parent.resolve() == ckpt.resolve()]
    return {n: names.count(n) for n in sorted(set(names))}


def copy_with_damaged_ema(run: Path, to: Path) -> Path:
    """A copy of `run` whose newest checkpoint's EMA file has its last byte flipped (same size)."""
    import shutil

    shutil.copytree(run, to)
    ema = to / "checkpoints" / "step_0000006" / "ema.safetensors"
    data = bytearray(ema.read_bytes())
    data[-1] ^= 0xFF
    ema.write_bytes(bytes(data))
    return to


def test_a_run_loads_reading_each_file_it_uses_once(trained):
    seen = probe(trained)
    newest = sorted((trained / "checkpoints").iterdir())[-1]
    assert reads_in(seen, newest) == {"ema.safetensors": 1, "state.json": 1, "state.sha256": 1}
    assert reads_in(seen, trained) == {"run.json": 1}  # the record, once
    older = [p for p in seen["opened"] if "step_0000003" in p]
    assert not older, f"an older checkpoint was read: {older}"
    training = {"elflow.optim", "elflow.train", "elflow.config", "elflow.schedule", "elflow.lifecycle.claim"}
    assert not training & set(seen["modules"]), training & set(seen["modules"])  # no training code, nor its spec


def module_calls(fn, *args, **kw) -> set[tuple[str, str]]:
    """(caller module, called module) of every call `fn` makes from one elflow module into another (elflow.util
    aside: helpers any module may call), seen by a profile hook."""
    import sys

    edges, stack = set(), []

    def module(frame):
        name = frame.f_globals.get("__name__", "")
        return name if name.startswith("elflow") and not name.startswith("elflow.util") else None

    def hook(frame, event, arg):
        if event == "call":
            here = None if frame.f_code.co_name == "<module>" else module(frame)
            caller = next((m for m in reversed(stack) if m is not None), None)
            if here is not None and caller is not None and here != caller:
                edges.add((caller, here))
            stack.append(here)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(hook)
    try:
        fn(*args, **kw)
    finally:
        sys.setprofile(None)
    return edges


LOAD_MODULES = 10  # find the model and read its record and weights (load; checkpoint, record) -> the space (space,
# encoders) -> the network (methods, methods.elf, model; the record's parts: flow, sampler) -> the weights, checked
# (load)


def test_loading_goes_one_way_through_few_modules(trained):
    """load_for_sampling's calls between elflow modules go one way: no module calls back into one that called it,
    directly or through others (the graph of module calls has no cycle), through at most LOAD_MODULES modules."""
    import graphlib

    from elflow.runs.load import load_for_sampling

    edges = module_calls(load_for_sampling, str(trained), device="cpu")
    modules = {m for edge in edges for m in edge}
    assert len(modules) <= LOAD_MODULES, sorted(modules)
    callers = {m: {a for a, b in edges if b == m} for m in modules}
    order = list(graphlib.TopologicalSorter(callers).static_order())  # CycleError: a call back
    assert order[0] == "elflow.runs.load"


def test_elflow_sample_reads_each_file_it_uses_once(trained, tmp_path):
    """`elflow sample RUN` reaches its JSONL line reading what loading reads, once each: no second read of the
    record, never the optimiser state."""
    seen = probe(trained, str(tmp_path / "s.jsonl"))
    newest = sorted((trained / "checkpoints").iterdir())[-1]
    assert reads_in(seen, newest) == {"ema.safetensors": 1, "state.json": 1, "state.sha256": 1}
    assert (tmp_path / "s.jsonl").read_text().count("\n") == 1


@pytest.fixture(scope="module")
def learned_table_run(tmp_path_factory, tiny_t5_dir, tiny_corpus_file, cache):
    from helpers import tiny_config

    from elflow.train import train

    run = tmp_path_factory.mktemp("learned") / "run"
    train(tiny_config(tiny_t5_dir, tiny_corpus_file, space={"kind": "learned-table", "name": str(tiny_t5_dir), "dim": 8}, steps=2,
                      ckpt_every=2), run, cache_dir=cache, quiet=True)
    return run


def test_a_learned_space_comes_from_the_same_read_as_the_weights(learned_table_run):
    """A learned table's parameters (space.safetensors) are read once, beside the EMA weights; the trained
    weights are not read."""
    seen = probe(learned_table_run)
    ckpt = learned_table_run / "checkpoints" / "step_0000002"
    assert reads_in(seen, ckpt) == {"ema.safetensors": 1, "space.safetensors": 1, "state.json": 1,
                                    "state.sha256": 1}


def test_the_record_is_run_json_s_and_a_checkpoint_names_it_by_its_digest(trained, tmp_path):
    """A checkpoint's state.json holds no record: it names the model by the digest of run.json's. The sampling
    defaults, which a resume may change, are outside the digest: every checkpoint samples with the run's. A
    run.json whose record was edited after the save (another recipe) is refused in one line naming it."""
    import shutil

    from elflow.runs.load import read_record
    from elflow.runs.record import RunRecord
    from elflow.util.errors import ELFError

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    doc = json.loads((run / "run.json").read_text())
    for state in run.glob("checkpoints/*/state.json"):
        stored = json.loads(state.read_text())
        assert "record" not in stored and stored["model_sha256"] == RunRecord.from_dict(doc["record"]).digest()
    doc["record"]["sampling"]["steps"] = 3
    (run / "run.json").write_text(json.dumps(doc))
    assert read_record(run).sampling.steps == 3
    assert read_record(run / "checkpoints" / "step_0000003").sampling.steps == 3
    doc["record"]["recipe"]["noise_scale"] = 3.0
    (run / "run.json").write_text(json.dumps(doc))
    with pytest.raises(ELFError, match=r"run\.json describes another model than its checkpoint step_0000006 holds"):
        read_record(run)


def test_a_checkpoint_copied_out_of_its_run_says_where_its_record_is(trained, tmp_path):
    """A checkpoint folder read without its run: one line saying that its model is described by the run's
    run.json, which is not beside it; put back as RUN/checkpoints/step_N beside that run.json, it loads."""
    import shutil

    from elflow.runs.load import load_for_sampling
    from elflow.util.errors import ELFError

    alone = tmp_path / "step_0000006"
    shutil.copytree(trained / "checkpoints" / alone.name, alone)
    with pytest.raises(ELFError, match=r"step_0000006: a checkpoint read without its run: .* run\.json"):
        load_for_sampling(alone, device="cpu")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copy(trained / "run.json", tmp_path / "run")
    shutil.move(alone, tmp_path / "run" / "checkpoints")
    net, _ = load_for_sampling(tmp_path / "run" / "checkpoints" / alone.name, device="cpu")
    assert net.origin.step == 6 and net.origin.record_file == str(tmp_path / "run" / "run.json")


def test_a_damaged_newest_checkpoint_gives_way_to_the_one_before(trained, tmp_path, capsys):
    """The newest checkpoint's EMA file damaged: the run samples from the one before, with a warning naming the
    damaged file; the damaged checkpoint is read once."""

    from elflow.runs.load import load_for_sampling

    run = copy_with_damaged_ema(trained, tmp_path / "run")
    net, _ = load_for_sampling(run, device="cpu")
    assert net.origin.step == 3
    err = capsys.readouterr().err
    assert "warning: skipping a bad checkpoint" in err and "step_0000006/ema.safetensors" in err


RESUME_PROBE = r"""
import json, os, sys
opened = []

def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened.append(os.fsdecode(args[0]))

sys.addaudithook(hook)
from elflow.cli import main
code = main(["train", "--out", sys.argv[1], "--resume", "--steps", "7", "--quiet"])
print(json.dumps({"code": code, "opened": opened}))
"""


@pytest.mark.slow  # a whole resume in a fresh interpreter (18 s on 2 cores)
def test_a_resume_reads_each_file_of_its_checkpoint_once(trained, cache, tmp_path):
    """--resume chooses its checkpoint from state.json and the files' sizes, then loads each file once, checked
    on the bytes read: weights, EMA and optimiser state one open each."""
    import os
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    done = subprocess.run([sys.executable, "-c", RESUME_PROBE, str(run)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "ELFLOW_CACHE": str(cache),
                                            "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["code"] == 0
    counts = reads_in(seen, run / "checkpoints" / "step_0000006")
    assert {n: counts.get(n) for n in ("model.safetensors", "ema.safetensors", "optimizer.pt")} == \
        {"model.safetensors": 1, "ema.safetensors": 1, "optimizer.pt": 1}, counts
    assert counts.get("state.json") == 1, counts


def test_a_resume_whose_newest_checkpoint_is_damaged_says_what_to_do(trained, cache, tmp_path, capsys):
    """A weight file of the newest checkpoint changed in place (same size): the resume that loads it refuses in
    one line naming the file, changes nothing, and says how to resume from the checkpoint before it."""

    from elflow.cli import main

    run = copy_with_damaged_ema(trained, tmp_path / "run")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "lock"}
    assert main(["train", "--out", str(run), "--resume", "--steps", "7", "--quiet", "--cache-dir", str(cache)]) != 0
    err = capsys.readouterr().err
    assert "step_0000006/ema.safetensors: corrupted" in err and "move step_0000006 out of" in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "lock"} == before


def test_the_finiteness_check_of_loaded_weights_agrees_with_a_value_by_value_check():
    """`all_finite` (a sum where it proves the answer) against torch.isfinite on every value: any NaN or
    infinity among finite values of each dtype, and sums that overflow while every value is finite."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from elflow.runs.checkpoint import all_finite

    dtypes = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])
    values = st.lists(st.one_of(st.floats(-1e6, 1e6), st.sampled_from([float("nan"), float("inf"), -float("inf"),
                                                                       3e38, -3e38, 65504.0])), max_size=40)

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(values, dtypes)
    def agrees(vals, dtype):
        w = torch.tensor(vals, dtype=torch.float64).to(dtype)
        assert all_finite(w) == bool(torch.isfinite(w).all())

    agrees()
    assert all_finite(torch.full((4,), 3e38, dtype=torch.bfloat16))  # finite values, an infinite fp32 sum
    assert all_finite(torch.full((100_000,), 65504.0, dtype=torch.float16))
    assert not all_finite(torch.tensor([1.0, float("inf"), -float("inf")]))
