"""Runs written by earlier elflows, read and continued by the code of today.

tests/fixtures/legacy holds what the code before the redesign (commit 7c8d27f) wrote, and tests/fixtures/record2
what the last code that wrote records of version 2 (commit 4ca85ef) wrote, flow-map students included: runs of ELF, of conditional ELF and of the AR and MDLM
baselines, each complete and stopped half-way, a progressive distillation (complete and stopped), the folder
`elflow push` uploads and an authors' checkpoint converted; with the texts the old code sampled from each
(expected/, with the commands that sampled them) and make.sh, which made it all. Today's code must:

- load every run, checkpoint, model folder and converted checkpoint (`elflow.load`: the stored EMA weights);
- sample from each, with the same flags and seed, exactly the texts the old code sampled;
- resume each stopped run to the end of its schedule and end with the complete run's last checkpoint,
  weights, EMA and optimiser state (RNG states included) equal tensor for tensor.

The runs store paths relative to the fixture's root (their space's tokenizer ./t5-tiny, their data
corpus.txt or pairs.jsonl, a distillation's teacher elf/...), so each test works in a copy of the fixture
and from that copy's root; the fixture itself is never written (test_the_fixture_is_unchanged checks).
Everything runs on the CPU, where the fixture was made.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every input is in the fixture
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from helpers import assert_same
from safetensors.torch import load_file

# this file is tests/<folder>/test_legacy_runs.py; the fixtures are tests/fixtures/<name>
N = 1
FIXTURES = {name: Path(__file__).resolve().parents[N] / "fixtures" / name for name in ("legacy", "record2")}
if not (FIXTURES["legacy"] / "SHA256SUMS").is_file() and (Path(__file__).resolve().parent / "SHA256SUMS").is_file():
    FIXTURES = {"legacy": Path(__file__).resolve().parent}  # run from inside the fixture's own folder
# (fixture, {"name", "argv"}): `elflow ARGV --out expected/NAME.jsonl` made each expected file
COMMANDS = [(name, json.loads(line)) for name, root in FIXTURES.items()
            for line in (root / "expected" / "commands.jsonl").read_text().splitlines()]
# the flags make.sh distilled pd and pd-stopped with (a distillation's flags are given again on --resume)
DISTILL = ["elf", "--student-steps", "2,1", "--teacher-steps", "4", "--steps-per-round", "2", "--lr", "3e-3",
           "--ema-decay", "0.5", "--log-every", "1", "--ckpt-every", "2"]
# and the flow-map student's (record2 only)
FLOW_MAP = ["elf", "--objective", "flow-map", "--steps", "4", "--lr", "3e-3", "--ema-decay", "0.5", "--log-every",
            "1", "--ckpt-every", "2"]
# beside the fixture when the test is run from it (helpers.py: tests/helpers.py, which it imports)
NOT_FIXTURE = ("__pycache__", "test_*.py", "conftest.py", "helpers.py")
SCRIPTS = ("SHA256SUMS", "make.sh", "make_helpers.py", "README.md")  # what made the fixture, and its list


def copy_fixture(to: Path, name: str = "legacy") -> Path:
    shutil.copytree(FIXTURES[name], to, ignore=shutil.ignore_patterns(*NOT_FIXTURE))
    return to


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoint(run: Path, step: int) -> Path:
    """The run's checkpoint folder of `step`."""
    folder = run / "checkpoints" / f"step_{step:07d}"
    found = sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []
    assert folder.is_dir(), f"{run} has no checkpoint of step {step} (it has {found})"
    return folder


def weights_file(path: Path) -> Path:
    """The EMA weights a run, checkpoint, model folder or converted checkpoint stores (what elflow.load reads)."""
    if (path / "checkpoints").is_dir():
        path = max((path / "checkpoints").glob("step_*"))
    return path / "ema.safetensors" if (path / "ema.safetensors").is_file() else path / "model.safetensors"


# the processor each fixture was made on (/proc/cpuinfo's model name): a resume there must match the fixture bit
# for bit. On another processor the float kernels round differently, and the earlier update rules' Newton-Schulz
# runs in bf16 on processors with fast bf16 matmuls (both fixtures' processors have them), whose rounding the
# orthogonalisation amplifies: there the two steps after the resume agree to about a tenth of a step (lr 3e-3)
# The processor is its model name and the vector width torch's CPU kernels dispatch to
# (torch.backends.cpu.get_cpu_capability()): one model name covers processors of either width, and the kernels of
# each width round differently (an AVX2-only AMD EPYC resumes the legacy runs to within 1.2e-6 of the fixture, not
# bit for bit, so the legacy fixture's EPYC ran the AVX512 kernels, as record2's Xeon with AMX-BF16 does)
MADE_ON = {"legacy": ("AMD EPYC", "AVX512"), "record2": ("Intel(R) Xeon(R) Processor", "AVX512")}
# torch's CPU threads when the fixture was made (None: the machine's default), which the order of its float
# reductions follows; the resume tests use the same
THREADS = {"legacy": None, "record2": 1}


@pytest.fixture
def fixture_threads():
    """Set torch's thread count to a fixture's THREADS for one test, then back."""
    before = torch.get_num_threads()
    yield lambda fixture: THREADS[fixture] and torch.set_num_threads(THREADS[fixture])
    torch.set_num_threads(before)


def this_cpu() -> tuple[str, str]:
    """(model name, the vector width of torch's CPU kernels) of this machine."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return name, torch.backends.cpu.get_cpu_capability()


LR = 3e-3  # make.sh's learning rate of every run and student


def assert_same_checkpoint(got: Path, want: Path, fixture: str) -> None:
    """The resumed checkpoint `got` holds the complete run's weights, EMA and optimiser state (RNG states
    included): bit for bit on the processor that made the fixture. On another, the optimiser's moments and the
    EMA agree to rtol 1e-2 / atol 1e-3, and the weights to within one step of the learning rate per entry: an
    entry of Muon's orthogonalised update is at most about lr, and where Newton-Schulz runs in bf16 on one
    processor and in fp32 on the other, the updates of the steps after the resume differ by up to half of that
    (measured on an AVX2-only AMD EPYC: 1.9e-3 at most)."""
    (made_on, width), (name, here) = MADE_ON[fixture], this_cpu()
    exact = made_on in name and width == here
    for name in ("model.safetensors", "ema.safetensors"):
        assert_same(load_file(got / name), load_file(want / name), f"{got / name}", exact,
                    atol=LR if name == "model.safetensors" else 1e-3)
    assert_same(torch.load(got / "optimizer.pt", weights_only=True),
                torch.load(want / "optimizer.pt", weights_only=True), f"{got / 'optimizer.pt'}", exact)


@pytest.fixture(scope="module")
def fixture_copies(tmp_path_factory) -> dict:
    """One copy of each fixture for the tests that only read (loading and sampling)."""
    return {name: copy_fixture(tmp_path_factory.mktemp(name) / name, name) for name in FIXTURES}


@pytest.mark.parametrize("fixture, command", COMMANDS, ids=[f"{f}-{c['name']}" for f, c in COMMANDS])
def test_loads_and_samples_the_old_texts(fixture, command, fixture_copies, tmp_path, monkeypatch):
    import elflow
    from elflow.cli import main

    monkeypatch.chdir(fixture_copies[fixture])
    path = command["argv"][1]  # sample PATH FLAGS...
    net = elflow.load(path)  # the stored EMA weights, in eval mode, whatever the parameters are now called
    assert not net.training
    stored = sorted((tuple(t.shape), t.flatten().tolist()) for t in load_file(weights_file(Path(path))).values())
    loaded = sorted((tuple(t.shape), t.flatten().tolist()) for t in net.state_dict().values())
    assert loaded == stored, f"elflow.load({path!r}) holds other weights than {weights_file(Path(path))}"

    out = tmp_path / "samples.jsonl"
    assert main([*command["argv"], "--out", str(out)]) == 0
    want = read_jsonl(FIXTURES[fixture] / "expected" / f"{command['name']}.jsonl")
    got = read_jsonl(out)
    assert [r["text"] for r in got] == [r["text"] for r in want]
    for field in ("source", "reference"):  # a conditional model's: one output per source, in order
        assert [r.get(field) for r in got] == [r.get(field) for r in want]


@pytest.mark.parametrize("fixture", list(FIXTURES))
@pytest.mark.parametrize("name", ["elf", "cond", "ar", "mdlm"])
def test_a_stopped_run_resumes_to_the_complete_run(fixture, name, tmp_path, monkeypatch, fixture_threads):
    from elflow.cli import main

    fixture_threads(fixture)
    root = copy_fixture(tmp_path / fixture, fixture)
    monkeypatch.chdir(root)
    assert main(["train", "--out", f"{name}-stopped", "--resume", "--quiet", "--device", "cpu",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    assert_same_checkpoint(checkpoint(root / f"{name}-stopped", 4), checkpoint(FIXTURES[fixture] / name, 4), fixture)


@pytest.mark.parametrize("fixture", list(FIXTURES))
def test_a_stopped_distillation_resumes_to_the_complete_one(fixture, tmp_path, monkeypatch, fixture_threads):
    from elflow.cli import main

    fixture_threads(fixture)
    root = copy_fixture(tmp_path / fixture, fixture)
    monkeypatch.chdir(root)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # distill has no --device: the CPU's numbers
    assert main(["distill", *DISTILL, "--out", "pd-stopped", "--resume", "--quiet",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    for student in ("2-step", "1-step"):
        assert_same_checkpoint(checkpoint(root / "pd-stopped" / student, 2),
                               checkpoint(FIXTURES[fixture] / "pd" / student, 2), fixture)


@pytest.mark.skipif("record2" not in FIXTURES, reason="the record2 fixture is not beside this file")
def test_a_stopped_flow_map_student_resumes_to_the_complete_one(tmp_path, monkeypatch, fixture_threads):
    from elflow.cli import main

    fixture_threads("record2")
    root = copy_fixture(tmp_path / "record2", "record2")
    monkeypatch.chdir(root)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["distill", *FLOW_MAP, "--out", "fm-stopped", "--resume", "--quiet",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    assert_same_checkpoint(checkpoint(root / "fm-stopped", 4), checkpoint(FIXTURES["record2"] / "fm", 4), "record2")


@pytest.mark.parametrize("fixture", list(FIXTURES))
def test_the_fixture_is_unchanged(fixture):
    """Every file of the fixture is as make.sh wrote it (SHA256SUMS), and there is no other."""
    root = FIXTURES[fixture]
    listed = dict(reversed(line.split(maxsplit=1)) for line in (root / "SHA256SUMS").read_text().splitlines())
    present = set()
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        own = len(rel.parts) == 1 and (rel.name in SCRIPTS or any(rel.match(p) for p in NOT_FIXTURE))
        if path.is_file() and "__pycache__" not in rel.parts and not own:
            present.add(rel.as_posix())
    assert present == set(listed), f"added: {sorted(present - set(listed))}, missing: {sorted(set(listed) - present)}"
    changed = [n for n, d in listed.items() if hashlib.sha256((root / n).read_bytes()).hexdigest() != d]
    assert not changed, f"changed: {changed}"


KILLED_BEFORE_FIRST_CHECKPOINT = """
import os, signal, sys
import elflow.train
elflow.train.train_loop = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # run.json is written by now
from elflow.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("fixture", list(FIXTURES))
@pytest.mark.parametrize("name", ["elf", "cond", "ar", "mdlm"])
def test_a_resume_killed_before_its_first_checkpoint_leaves_a_run_that_resumes(fixture, name, tmp_path, monkeypatch,
                                                                             fixture_threads):
    """SIGKILL after a resume rewrote an older run's run.json (today's layout, absolute paths) and before its
    first checkpoint: the next command puts run.json back as it was, and the run resumes to the complete run."""
    import subprocess
    import sys

    from elflow.cli import main

    fixture_threads(fixture)
    root = copy_fixture(tmp_path / fixture, fixture)
    monkeypatch.chdir(root)
    run = root / f"{name}-stopped"
    before = (run / "run.json").read_bytes()
    argv = ["train", "--out", run.name, "--resume", "--quiet", "--device", "cpu", "--cache-dir", str(tmp_path / "c")]
    killed = subprocess.run([sys.executable, "-c", KILLED_BEFORE_FIRST_CHECKPOINT, *argv], cwd=root, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
    assert killed.returncode == -9
    assert (run / "run.json").read_bytes() != before and (run / ".run-before-resume.json").is_file()
    assert main(argv) == 0
    assert not (run / ".run-before-resume.json").exists()
    assert_same_checkpoint(checkpoint(run, 4), checkpoint(FIXTURES[fixture] / name, 4), fixture)


# SIGKILL at the Nth rename of a command (ELFLOW_KILL_AT = N): every file the trainer writes lands by a rename
# (an atomic write, a checkpoint's folder, a run set aside), so these are the moments its folder changes
KILLED_AT_RENAME = """
import os, signal, sys
import torch
if os.environ.get("ELFLOW_THREADS"):  # the fixture's own (THREADS), for the checkpoints this process writes
    torch.set_num_threads(int(os.environ["ELFLOW_THREADS"]))
n, seen = int(os.environ["ELFLOW_KILL_AT"]), [0]
def counted(real):
    def rename(*a, **k):
        seen[0] += 1
        if seen[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    return rename
os.replace, os.rename = counted(os.replace), counted(os.rename)
from elflow.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fixture", list(FIXTURES))
def test_a_resume_killed_at_any_of_its_writes_leaves_a_run_that_resumes(fixture, tmp_path, monkeypatch,
                                                                       fixture_threads):
    """SIGKILL at each rename a resume of an older run makes, one fresh copy of the stopped run per rename, from
    its first (the earlier run.json kept) to its last: each time, the next command resumes the run to the
    complete run's last checkpoint bit for bit."""
    import itertools
    import subprocess
    import sys

    from elflow.cli import main

    fixture_threads(fixture)
    src = str(Path(__file__).resolve().parents[2] / "src")
    for n in itertools.count(1):
        root = copy_fixture(tmp_path / f"{fixture}-{n}", fixture)
        monkeypatch.chdir(root)
        argv = ["train", "--out", "elf-stopped", "--resume", "--quiet", "--device", "cpu", "--cache-dir",
                str(tmp_path / "c")]
        killed = subprocess.run([sys.executable, "-c", KILLED_AT_RENAME, *argv], cwd=root, timeout=600,
                                env={**os.environ, "PYTHONPATH": src, "ELFLOW_KILL_AT": str(n),
                                     "ELFLOW_THREADS": str(THREADS[fixture] or "")})
        if killed.returncode == 0:  # past the resume's last rename: it ran whole
            break
        assert killed.returncode == -9, n
        assert main(argv) == 0, n
        assert_same_checkpoint(checkpoint(root / "elf-stopped", 4), checkpoint(FIXTURES[fixture] / "elf", 4), fixture)
    assert n > 5  # (the earlier run.json kept, run.json, each checkpoint's files and folder, ...)


def test_an_older_checkpoint_samples_with_its_run_s_current_defaults(tmp_path):
    """A resume with --sample-steps 3 --sample-omega 2 changes run.json's record: every checkpoint of the run
    samples with them, also one of an earlier layout whose state.json carries its own record (with the
    defaults of its save). Read without its run, such a checkpoint keeps its own."""
    import elflow
    from elflow.runs.load import read_record

    root = copy_fixture(tmp_path / "record2", "record2")  # (the first layout's run.json holds no record)
    run = root / "elf-stopped"
    doc = json.loads((run / "run.json").read_text())
    record = doc["record"]
    record["sampling"] = {**record["sampling"], "steps": 3, "omega": 2.0}
    (run / "run.json").write_text(json.dumps(doc))
    ckpt = checkpoint(run, 2)
    assert "record" in json.loads((ckpt / "state.json").read_text())  # one of an earlier layout
    for path in (run, ckpt):
        sampling = read_record(str(path)).sampling
        assert (sampling.steps, sampling.omega) == (3, 2.0), path
    alone = tmp_path / "alone"
    shutil.copytree(ckpt, alone)
    assert elflow.load(str(alone)).record.sampling.steps == 32
