"""Trajectory pages whose embedded data parses as strict JSON: from a trajectory holding non-finite numbers,
and from `elflow sample --html`."""
import json
import re
import shutil
import subprocess
from pathlib import Path

from helpers import cli, sampled_trajectory

from elflow.cli import main

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------------
# behaviour
def _page_data(page: Path):
    """The trajectory embedded in a page, read as strict JSON (NaN or Infinity would fail, as in JSON.parse)."""
    m = re.search(r'<script type="application/json" id="trajectory-data">(.*?)</script>', page.read_text(), re.S)

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(m.group(1), parse_constant=refuse)


def test_a_trajectory_with_non_finite_numbers_makes_a_page_whose_data_parses(capsys, tmp_path, trained_with_trajectory):
    doc = json.loads(sampled_trajectory(trained_with_trajectory).read_text())
    doc["steps"][0]["t"], doc["steps"][1]["t"] = float("nan"), float("inf")
    doc["settings"]["omega"] = float("-inf")
    src = tmp_path / "nan.trajectory.json"
    src.write_text(json.dumps(doc))  # Python writes NaN / Infinity, as a hand-edited or foreign file may hold
    assert "NaN" in src.read_text() and "Infinity" in src.read_text()
    code, _, err = cli(capsys, ["view", src])
    assert code == 0, err
    data = _page_data(tmp_path / "nan.trajectory.html")
    assert data["steps"][0]["t"] is None and data["steps"][1]["t"] is None and data["settings"]["omega"] is None
    assert data["steps"][2]["t"] == doc["steps"][2]["t"]  # finite numbers as they were
    assert '"n/a"' in (tmp_path / "nan.trajectory.html").read_text()  # what the page shows for a null t
    node = shutil.which("node")
    if node:  # the browser's parser itself, where one is at hand
        script = ("const fs = require('fs'); const s = fs.readFileSync(process.argv[1], 'utf8');"
                  "const m = /id=\"trajectory-data\">([\\s\\S]*?)<\\/script>/.exec(s);"
                  "const d = JSON.parse(m[1]); process.stdout.write(String(d.steps[0].t));")
        r = subprocess.run([node, "-e", script, str(tmp_path / "nan.trajectory.html")], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == "null", r.stderr
        from elflow.experiments.viewer import _SCRIPT  # and what the page's script shows for a t

        [fmt] = [line for line in _SCRIPT.splitlines() if line.strip().startswith("const fmt = ")]
        r = subprocess.run([node, "-e", fmt + "\nprocess.stdout.write([null, 0.25, 1].map(fmt).join(' '))"],
                           capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == "n/a 0.250 1.000", r.stderr


def test_a_sampled_page_still_parses_strictly(trained_with_trajectory, tmp_path):
    """The page `sample --html` writes holds strict JSON too (finite numbers only)."""
    page = tmp_path / "p.jsonl"
    assert main(["sample", str(trained_with_trajectory), "--num", "1", "--steps", "2", "--html", "--quiet", "--out",
                 str(page)]) == 0
    assert _page_data(page.with_suffix(".trajectory.html"))["samples"][0]["text"] == \
        json.loads(page.read_text())["text"]
