"""The package's layers: each module imports only from layers below its own, so data flows one way
(text -> space -> method -> network -> sampler -> text) and there is no import cycle."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "elflow"

# bottom to top; a module may import from strictly lower layers only. Modules of a package are named with
# their package ("methods.elf"); the package's __init__ by the package's name.
LAYERS = [
    ["utils"],
    ["model", "optim", "gpt2_tokenizer", "viewer", "tracking"],
    ["official", "schedules"],
    ["flow"],
    ["data", "store"],
    ["encoders", "ingest", "encoder_train"],
    ["shortrun"],
    ["generate", "diagnostics", "judge"],
    ["methods.base"],
    ["methods.tokens", "methods.elf"],
    ["methods.ar", "methods.mdlm"],
    ["methods"],
    ["runconfig"],
    ["checkpoint"],
    ["runfolder"],
    ["train"],
    ["sample", "distill", "evaluate", "bench", "prepare", "hub"],
    ["sweep", "compare", "toy"],
    ["quickstart", "claims"],
    ["cli", "__init__"],
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def module_name(parts: list[str]) -> str:
    """elflow.X.Y -> "X.Y"; a name that is no module (a function of module X) -> "X"."""
    name = ".".join(parts)
    return name if name in RANK or len(parts) == 1 else module_name(parts[:-1])


def imports_of(source: str) -> set[str]:
    """The elflow modules a source imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "elflow":
            parts = node.module.split(".")[1:]
            for a in node.names:  # from elflow.X import Y: module X.Y if there is one, else X
                found.add(module_name(parts + [a.name]) if parts else a.name)
        elif isinstance(node, ast.Import):
            found.update(module_name(a.name.split(".")[1:]) for a in node.names if a.name.startswith("elflow."))
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
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE).with_suffix("").parts)
        if len(parts) > 1 and parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p.read_text()
    return out


def test_every_import_points_down():
    assert violations(package_sources()) == []


@pytest.mark.parametrize("module,injected", [
    ("utils", "from elflow.cli import main\n"),  # the bottom importing the top
    ("flow", "def f():\n    from elflow.generate import generate\n"),  # hidden in a function
    ("sample", "import elflow.distill\n"),  # a sideways import within one layer
    ("methods.ar", "from elflow.methods.mdlm import draw\n"),  # sideways, inside a package
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


def method_name_comparisons(sources: dict[str, str]) -> list[str]:
    """'module:line' of every comparison (==, !=, in, not in, is) of a string that is a method's name, in the
    modules outside the registry (elflow.methods). Syntactic, so it also counts a string that equals a method's
    name by coincidence (evaluate's protocol names "elf" and "mdlm")."""
    from elflow.methods import METHOD_NAMES

    def strings(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for e in node.elts:
                yield from strings(e)

    found = []
    for name, source in sorted(sources.items()):
        if name == "methods" or name.startswith("methods."):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Compare) and any(
                    s in METHOD_NAMES for side in [node.left, *node.comparators] for s in strings(side)):
                found.append(f"{name}:{node.lineno}")
    return found


def test_at_most_three_comparisons_on_a_method_name_outside_the_registry():
    found = method_name_comparisons(package_sources())
    assert len(found) <= 3, found
    # the counter sees a comparison hidden anywhere
    sources = package_sources()
    sources["sweep"] += "\ndef f(m):\n    return m.name in ('ar', 'x') or 'mdlm' == m.name\n"
    assert len(method_name_comparisons(sources)) == len(found) + 2
