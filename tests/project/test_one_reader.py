"""Every file of a run is read by the one bounded reader and written by the one writer (elflow.util.jsonio,
elflow.util.files): no other module of the package opens, reads or writes a file by itself, except the calls
listed in ALLOWED, which touch files that are no run's (the machine's /proc, a corpus, a token store, a
tokenizer in the cache, a temporary folder that is moved into place whole). A new raw call fails this test:
route it through the helpers, or, for a file that is no run's, list it here with the reason."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "elflow"

# the one reader and the one writer themselves
HELPERS = {"util/files.py", "util/jsonio.py"}

RAW_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes"}  # pathlib's whole-file reads and writes
LOADERS = {("torch", "load"), ("torch", "save"), ("json", "load"), ("json", "dump"), ("np", "load"),
           ("np", "fromfile"), ("np", "memmap"), ("pickle", "load")}
PATH_WRITERS = {"savefig", "save_file"}  # third-party writers that take a path (or a file atomic_write opened)

# (module, function, call) -> why it is no raw access to a run's file
ALLOWED = {
    # the machine's own files
    ("util/devices.py", "cpu_flags", "open"): "/proc/cpuinfo",
    ("util/devices.py", "device_name", "open"): "/proc/cpuinfo",
    ("util/budget.py", "_machine_file", "open"): "/proc and the process's cgroup files",
    ("eval/mauve.py", "_quiet_native_stderr", "open"): "os.devnull",
    # corpora: a user's text, and the built-in corpus unpacked into a temporary folder of the cache
    ("data/corpus.py", "_extract_works", "tarfile.open"): "the built-in corpus's downloaded archive",
    ("data/corpus.py", "_extract_works", "write_text"): "a text of the built-in corpus, in its temporary folder",
    ("data/corpus.py", "builtin_corpus", "write_text"): "the built-in corpus's manifest, in its temporary folder",
    ("data/corpus.py", "_read_text_file", "read_bytes"): "a corpus text file (local_files lists regular files)",
    ("data/origins.py", "file_pieces", "open"): "a large corpus text file, read in pieces",
    ("data/origins.py", "read_small_file", "open"): "a corpus file, read to its listed size plus one byte",
    # a token store: its own writer (files under .partial names, renamed when complete), map and locks
    ("data/store.py", "StoreWriter.__init__", "open"): "the store's ids and offsets, written as .partial files",
    ("data/store.py", "_map", "np.memmap"): "the store's ids, memory-mapped read-only",
    ("data/store_folder.py", "file_lock", "open"): "the store's flock file",
    ("data/store_folder.py", "locked_by_other", "open"): "the store's flock file",
    ("data/store_folder.py", "folder_flock", "os.open"): "a store folder, opened to flock it",
    ("data/store_folder.py", "_sync_folder", "os.open"): "a store folder, opened to fsync it",
    # tokenizers
    ("eval/gpt2_tokenizer.py", "fetch_gpt2_ranks", "read_bytes"): "the GPT-2 ranks and their archive in the cache",
    ("eval/gpt2_tokenizer.py", "fetch_gpt2_ranks", "tarfile.open"): "the GPT-2 ranks' archive in the cache",
    ("eval/gpt2_tokenizer.py", "load_ranks", "read_bytes"): "the GPT-2 ranks in the cache",
    ("experiments/encoder_train.py", "_tokenizer", "write_text"): "sentencepiece's input, in a temporary folder",
    ("experiments/encoder_train.py", "_tokenizer", "read_text"): "sentencepiece's input, in a temporary folder",
    # a checkpoint is built in a temporary folder that is renamed into place whole; its reads are bounded
    ("runs/checkpoint.py", "write_checkpoint", "open"): "optimizer.pt in the temporary folder; fsync of its files",
    ("runs/checkpoint.py", "write_checkpoint", "torch.save"): "optimizer.pt in the temporary folder",
    ("runs/checkpoint.py", "write_checkpoint", "save_file"): "the weights in the temporary folder",
    ("runs/checkpoint.py", "read_optimizer_state", "torch.load"): "bytes the bounded reader read (io.BytesIO)",
    # a released checkpoint (no run's file), loaded from the file jsonio.open_regular opened
    ("runs/released.py", "read_released_checkpoint", "torch.load"): "a file jsonio.open_regular opened",
}


def _call_name(node: ast.Call, atomic: set[str]) -> str | None:
    """The raw file access `node` makes ("open", "os.open", "read_text", "torch.load", ...), None for none.
    `.open()` without arguments is a FolderHold's or a RunFolder's, not a file's; a PATH_WRITERS call given a
    file that `with atomic_write(...) as f` opened writes through the one writer."""
    f = node.func
    if isinstance(f, ast.Name):
        if f.id in PATH_WRITERS:
            return None if node.args and _name_of(node.args[-1 if f.id == "save_file" else 0]) in atomic else f.id
        return f.id if f.id in ("open", "safe_open", "load_file") else None
    if not isinstance(f, ast.Attribute):
        return None
    base = f.value.id if isinstance(f.value, ast.Name) else None
    if f.attr in RAW_METHODS:
        return f.attr
    if f.attr == "open" and (node.args or node.keywords):
        return f"{base}.open" if base in ("os", "io", "tarfile", "gzip") else "open"
    if (base, f.attr) in LOADERS:
        if f.attr == "save" and len(node.args) > 1 and _name_of(node.args[1]) in atomic:
            return None
        return f"{base}.{f.attr}"
    if f.attr in PATH_WRITERS:
        return None if node.args and _name_of(node.args[0]) in atomic else f.attr
    return None


def _name_of(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


class _Finder(ast.NodeVisitor):
    """The raw file accesses of one module: (module, enclosing function, call, line)."""

    def __init__(self, module: str):
        self.module, self.scope, self.atomic, self.hits = module, [], set(), []

    def _enter(self, node) -> None:
        outer, self.atomic = self.atomic, set()  # the names atomic_write opened, in this function
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()
        self.atomic = outer

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            call = item.context_expr
            if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", None)) == \
                    "atomic_write" and isinstance(item.optional_vars, ast.Name):
                self.atomic.add(item.optional_vars.id)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _call_name(node, self.atomic)
        if name is not None:
            self.hits.append((self.module, ".".join(self.scope) or "<module>", name, node.lineno))
        self.generic_visit(node)


def raw_accesses() -> list[tuple[str, str, str, int]]:
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module not in HELPERS:
            finder = _Finder(module)
            finder.visit(ast.parse(path.read_text(), str(path)))
            hits += finder.hits
    return hits


def test_no_module_reads_or_writes_a_file_but_through_the_one_reader_and_writer():
    new = [f"src/elflow/{m}:{line}: {call}(...) in {fn}" for m, fn, call, line in raw_accesses()
           if (m, fn, call) not in ALLOWED]
    assert not new, ("raw file access outside elflow.util.files / elflow.util.jsonio (read with "
                     "jsonio.read_limited / read_json / iter_jsonl / open_regular or files.read_own_text, write "
                     "with files.atomic_write* or append_own; a file that is no run's goes in ALLOWED with its "
                     "reason):\n" + "\n".join(new))


def test_every_allowed_access_still_exists():
    seen = {(m, fn, call) for m, fn, call, _ in raw_accesses()}
    stale = sorted(k for k in ALLOWED if k not in seen)
    assert not stale, f"ALLOWED lists accesses that are gone; remove them: {stale}"


def test_the_finder_sees_each_kind_of_raw_access():
    source = '''
def f(p, q):
    open(p)
    os.open(p, 0)
    p.read_text()
    p.write_bytes(b"")
    torch.load(p)
    fig.savefig(p)
    with atomic_write(q) as g:
        fig.savefig(g)
    hold.open()
'''
    finder = _Finder("m.py")
    finder.visit(ast.parse(source))
    assert [h[2] for h in finder.hits] == ["open", "os.open", "read_text", "write_bytes", "torch.load", "savefig"]
