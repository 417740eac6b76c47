"""The package's layers: each module imports only from layers below its own, so data flows one way
(text -> space -> method -> network -> sampler -> text) and there is no import cycle."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "elflow"

# bottom to top; a module may import from strictly lower layers only
LAYERS = [
    ["utils"],
    ["model", "optim", "gpt2_tokenizer"],
    ["official", "schedules"],
    ["flow", "ar", "mdlm"],
    ["data", "methods"],
    ["store"],
    ["encoders", "ingest"],
    ["checkpoint"],
    ["train", "generate", "diagnostics", "judge"],
    ["distill", "evaluate", "bench", "prepare"],
    ["sweep", "compare", "toy"],
    ["quickstart"],
    ["cli", "__init__"],
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def imports_of(source: str) -> set[str]:
    """The elflow modules a source imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "elflow":
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from elflow import x
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("elflow."))
    return found


def violations(sources: dict[str, str]) -> list[str]:
    bad = []
    for name, source in sorted(sources.items()):
        if name not in RANK:
            bad.append(f"{name}: not in any layer (add it to LAYERS)")
            continue
        for dep in sorted(imports_of(source) - {name}):
            if dep not in RANK:
                bad.append(f"{name} imports {dep}, which is in no layer")
            elif RANK[dep] >= RANK[name]:
                bad.append(f"{name} (layer {RANK[name]}) imports {dep} (layer {RANK[dep]})")
    return bad


def package_sources() -> dict[str, str]:
    return {p.stem: p.read_text() for p in PACKAGE.glob("*.py")}


def test_every_import_points_down():
    assert violations(package_sources()) == []


@pytest.mark.parametrize("module,injected", [
    ("utils", "from elflow.cli import main\n"),  # the bottom importing the top
    ("flow", "def f():\n    from elflow.generate import generate\n"),  # hidden in a function
    ("generate", "import elflow.train\n"),  # a sideways import within one layer
])
def test_an_upward_or_sideways_import_is_caught(module, injected):
    sources = package_sources()
    sources[module] += "\n" + injected
    assert any(v.startswith(module) for v in violations(sources))


def test_the_layers_admit_no_cycle():
    graph = {name: imports_of(src) & set(RANK) for name, src in package_sources().items()}
    seen, stack = set(), []

    def visit(n):
        assert n not in stack, f"import cycle: {' -> '.join(stack + [n])}"
        if n in seen:
            return
        stack.append(n)
        for d in graph.get(n, ()):
            visit(d)
        stack.pop()
        seen.add(n)

    for n in graph:
        visit(n)
