"""The README's Python example runs as shown, on a tiny trained run in place of runs/demo: loading, the record,
`generate`, and the sampling loop on the run's own noise scale and time grid."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_python() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(blocks) == 1, "the README shows one Python example"
    return blocks[0]


def test_the_readme_python_example_runs(trained, capsys):
    code = readme_python()
    assert code.count('"runs/demo"') == 2
    namespace: dict = {}
    exec(compile(code.replace('"runs/demo"', repr(str(trained))), "README.md", "exec"), namespace)
    assert len(namespace["records"]) == 4 and all("text" in r for r in namespace["records"])
    recipe, grid = namespace["recipe"], namespace["grid"]
    assert grid[0] == 0 and grid[-1] == 1 and len(grid) == 33  # the logit-normal grid of the run's recipe
    assert recipe == namespace["net"].record.recipe and len(namespace["texts"]) == 4
    assert str(namespace["net"].record.method) in capsys.readouterr().out
