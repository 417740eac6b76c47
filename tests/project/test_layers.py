"""The package's layers: each module imports only from layers below its own, so there is no import cycle and
the tree reads bottom up (util -> network and method -> space and data -> methods -> runs (a run's files) ->
config -> lifecycle (what a run does with them) -> train -> eval -> experiments -> cli). The network imports nothing of elflow but the error type; loading a model and generating
from it import neither the trainer nor its batches; argparse lives in elflow.cli alone."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "elflow"

# bottom to top; a module may import from strictly lower layers only. Modules are named by their path in the
# package ("runs.load"); a package's __init__ by the package's name ("methods").
LAYERS = [
    ["util.errors", "util", "data", "runs", "lifecycle", "eval", "experiments"],  # (the packages' docstrings)
    ["util.jsonio"],
    ["util.files", "util.devices", "util.distributed", "util.hub"],
    ["util.budget", "encoders"],
    ["model", "newton_schulz", "runs.tracking", "schedule", "declare"],
    ["optim", "flow", "runs.folder", "data.tasks", "data.layout", "data.integrity", "data.store_folder"],
    ["flowmap", "sampler", "data.corpus", "data.store", "data.batches"],
    ["space", "data.origins"],
    ["data.reading", "data.workers"],
    ["data.ingest"],
    ["data.datasets", "generate"],
    ["methods.base", "methods.token_net"],
    ["methods.baseline", "methods.elf"],
    ["methods.ar", "methods.mdlm", "methods.pd", "methods.lmd"],
    ["methods"],
    ["runs.record"],
    ["runs.migrate"],
    ["runs.checkpoint"],
    ["runs.released", "runs.model_folder", "runs.log"],
    ["runs.stored"],
    ["runs.load"],
    ["config", "lifecycle.outputs"],
    ["lifecycle.stages", "lifecycle.push"],
    ["lifecycle.claim"],
    ["train"],
    ["distill", "eval.gpt2_tokenizer", "eval.metrics", "eval.diagnostics"],
    ["eval.mauve"],
    ["eval.judge"],
    ["eval.scoring"],
    ["experiments.figures", "experiments.viewer", "experiments.schedules", "experiments.toy",
     "experiments.encoder_train", "experiments.bench"],
    ["experiments.sweep", "experiments.compare", "experiments.toy_distill"],
    ["experiments.quickstart", "experiments.claims"],
    ["cli.train_flags", "cli.common"],
    ["cli.quickstart", "cli.prepare", "cli.train", "cli.sample", "cli.view", "cli.distill", "cli.eval",
     "cli.train_judge", "cli.train_encoder", "cli.sweep", "cli.claims", "cli.compare", "cli.push", "cli.convert",
     "cli.bench", "cli.toy", "cli.schedules"],
    ["cli", "__init__"],
    ["cli.__main__"],
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
    ("util.errors", "from elflow.cli import main\n"),  # the bottom importing the top
    ("flow", "def f():\n    from elflow.generate import generate\n"),  # hidden in a function
    ("cli.sample", "import elflow.cli.distill\n"),  # a sideways import within one layer
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
    sources["experiments.sweep"] += "\ndef f(m):\n    return m.name in ('ar', 'x') or 'mdlm' == m.name\n"
    assert len(method_name_comparisons(sources)) == len(found) + 2


def test_argparse_is_used_in_the_command_line_package_alone():
    """No module outside elflow.cli imports argparse or adds arguments to a parser."""
    found = []
    for name, source in package_sources().items():
        if name == "cli" or name.startswith("cli."):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "argparse" in (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]):
                found.append(f"{name}: imports argparse")
            if isinstance(node, ast.Attribute) and node.attr in ("add_argument", "add_argument_group",
                                                                 "add_mutually_exclusive_group"):
                found.append(f"{name}:{node.lineno}: {node.attr}")
    assert found == []


def loaded_modules(code: str) -> set[str]:
    """The elflow modules a fresh interpreter holds after running `code`."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(m for m in sys.modules "
                          "if m == 'elflow' or m.startswith('elflow.'))))"], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(PACKAGE.parent)}, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_network_imports_nothing_of_elflow_but_the_error_type():
    assert loaded_modules("import elflow.model") == {"elflow", "elflow.model", "elflow.util", "elflow.util.errors"}


def test_loading_a_run_and_generating_from_it_imports_no_training_code(tmp_path, tiny_corpus_file):
    """elflow.load and a generation read the stored model and its record directly: no trainer, no training
    batches, no command line."""
    from elflow.cli import main

    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--length", "16", "--batch", "4",
                 "--steps", "1", "--warmup", "0", "--dtype", "fp32", "--quiet", "--out", str(run),
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    modules = loaded_modules(f"""
import elflow
from elflow.generate import SamplingSettings, generate
from elflow.runs.load import load_for_sampling
net = elflow.load({str(run)!r})
net, space = load_for_sampling({str(run)!r}, device="cpu")
texts = generate(net, space, 2, SamplingSettings(steps=2), progress=False)
assert len(texts) == 2
""")
    assert "elflow.runs.load" in modules and "elflow.generate" in modules  # it did load and generate
    assert not modules & {"elflow.train", "elflow.cli", "elflow.data.batches"}, sorted(modules)
    # and the command: `elflow sample RUN` imports no training code while it runs either
    modules = loaded_modules(f"""
from elflow.cli import main
assert main(["sample", {str(run)!r}, "--num", "2", "--steps", "2", "--quiet", "--out", {str(tmp_path / "s.jsonl")!r}]) == 0
""")
    assert "elflow.cli.sample" in modules and not modules & TRAINING_CODE, sorted(modules & TRAINING_CODE)


TRAINING_CODE = {"elflow.config", "elflow.train", "elflow.optim", "elflow.schedule", "elflow.newton_schulz",
                 "elflow.lifecycle.claim", "elflow.distill", "elflow.data.batches"}


def test_the_sample_command_imports_no_training_code():
    """`elflow sample RUN` reads a stored model: the training config, the trainer, the optimiser, its schedule
    and the run folder's lifecycle (lifecycle.claim) are never imported, whatever the command's helpers import."""
    modules = loaded_modules("import elflow.cli.sample")
    assert "elflow.runs.load" in modules and "elflow.generate" in modules
    assert not modules & TRAINING_CODE, sorted(modules & TRAINING_CODE)


def test_every_output_path_is_checked_by_the_one_output_check():
    """Outside lifecycle.outputs, util.files.check_output is called only where the path is a run's own folder (train,
    whose folder rules are lifecycle.claim's; a flow-map student's run in distill, refused inside any other run) or is
    checked again (push's library call, after the command's
    check_out): every other command's outputs get the run rule with the file rule."""
    callers = {name for name, src in package_sources().items()
               if any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "check_output"
                      for n in ast.walk(ast.parse(src)))}
    assert callers <= {"util.files", "lifecycle.outputs", "cli.train", "lifecycle.claim", "lifecycle.push", "distill"}, callers
