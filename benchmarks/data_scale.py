"""Data at scale: `elflow prepare` and a training start on generated corpora of growing size.

For each size the script writes a .jsonl corpus of English-like documents (words drawn with the built-in
corpus's word frequencies, documents of 200 to 2,000 words: about OpenWebText's 5 KB per document), then

1. runs `elflow prepare CORPUS --space minilm --workers W` in its own process and records the wall time, the
   CPU time of the whole process tree (main process and workers), the peak resident memory of the tree
   (sampled every 50 ms, the sum over its processes) and the store's bytes per token;
2. opens the store in a fresh process as training does (`ingest.build_dataset`, packed and document rows
   of L = 1024, the validation split, `Batches` of 64 rows) and records the time, the memory it adds and the
   time per batch fetch (warm page cache: the store was just written);
3. runs `elflow train --data STORE --defaults quickstart --steps 1` (the demo network, random-table space)
   and records its wall time from launch to exit and its peak memory.

Each figure is one JSON line in benchmarks/results/data_scale.jsonl, with the CPU model and the load
average before and after (the machine is shared: wall times are slowed by other work, CPU times much less).
`report` prints the table of RESULTS.md.

    python benchmarks/data_scale.py run --sizes 10M 100M 1G --workers 2 --dir .bench --delete
    python benchmarks/data_scale.py run --sizes 100M --text      # one 100 MB .txt file (a single document)
    python benchmarks/data_scale.py reopen store-1G-w2              # open and start a training again
    python benchmarks/data_scale.py rows store-1G-w2 --length 128   # millions of rows: the index's cost
    python benchmarks/data_scale.py report
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "data_scale.jsonl"
UNITS = {"K": 1e3, "M": 1e6, "G": 1e9}


def parse_size(text: str) -> int:
    return int(float(text[:-1]) * UNITS[text[-1].upper()]) if text[-1].upper() in UNITS else int(text)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"


def conditions() -> dict:
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "load": [round(x, 2) for x in os.getloadavg()]}


# ----------------------------------------------------------------------------------------------------
# corpora


def word_table():
    """The built-in corpus's words and their frequencies."""
    import collections

    import numpy as np

    from elflow.data.corpus import read_documents

    counts = collections.Counter(w for d in read_documents("builtin") for w in d.split())
    words, freq = zip(*counts.most_common(20000))
    p = np.asarray(freq, dtype=np.float64)
    return np.asarray(words, dtype=object), p / p.sum()


def write_corpus(path: Path, size: int, text_file: bool = False, seed: int = 0) -> Path:
    """About `size` bytes of generated documents: a .jsonl of {"text"} lines, or (text_file) one .txt."""
    import numpy as np

    if path.exists() and path.stat().st_size >= size:
        return path
    words, p = word_table()
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    with open(tmp, "w", encoding="utf-8") as f:
        while written < size:
            lengths = rng.integers(200, 2000, 256)
            ids = rng.choice(len(words), int(lengths.sum()), p=p)
            starts = np.concatenate([[0], np.cumsum(lengths)])
            for a, b in zip(starts[:-1], starts[1:]):
                doc = " ".join(words[ids[a:b]])
                line = doc + "\n\n" if text_file else json.dumps({"text": doc}) + "\n"
                f.write(line)
                written += len(line.encode())
                if written >= size:
                    break
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------------------
# measuring a process tree


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _rss(pid: int) -> tuple[int, int]:
    """(resident bytes, of which anonymous) of a process; the rest is mapped files (the page cache)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out.get("VmRSS", 0), out.get("RssAnon", 0)


def measure(cmd: list[str], env=None) -> dict:
    """Run `cmd`; wall time, CPU time of its tree, peak RSS of its tree (sum) and of its main process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_tree = peak_main = peak_anon = 0
    while proc.poll() is None:
        rss = [_rss(p) for p in _tree(proc.pid)]
        peak_tree = max(peak_tree, sum(r for r, _ in rss))
        peak_main = max(peak_main, rss[0][0] if rss else 0)
        peak_anon = max(peak_anon, sum(a for _, a in rss))
        time.sleep(0.05)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round((after.ru_utime - before.ru_utime)
                                                      + (after.ru_stime - before.ru_stime), 2),
            "peak_tree_rss_mb": round(peak_tree / 2**20, 1), "peak_main_rss_mb": round(peak_main / 2**20, 1),
            "peak_tree_anon_mb": round(peak_anon / 2**20, 1),
            "max_process_rss_mb": round(after.ru_maxrss / 1024, 1), "load_before": [round(x, 2) for x in load],
            "load_after": [round(x, 2) for x in os.getloadavg()], "stdout": out[-2000:]}


OPEN_SCRIPT = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
from elflow.data.batches import Batches
from elflow.space import build_space
from elflow.data.datasets import build_dataset
def rss(key="RssAnon"):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
space = build_space({"kind": "tokens", "of": {"kind": "hf", "name": "minilm"}})
base, base_file, t_import = rss(), rss("RssFile"), time.perf_counter() - t0
out = {"import_s": round(t_import, 2)}
import json as _json
records = _json.load(open(sys.argv[1] + "/manifest.json"))["records"]
for layout in ("packed", "document") if records >= 128 else ("packed",):  # a single document: no document rows
    t1 = time.perf_counter()
    train, val = build_dataset(sys.argv[1], space, 1024, layout=layout, val_fraction=0.0005, seed=0)
    batches = Batches(train, 64, seed=0)
    first = next(batches)
    t_open = time.perf_counter() - t1
    t2 = time.perf_counter()
    for _ in range(50):
        b = next(batches)
    out[layout] = {"rows": len(train), "open_split_first_batch_s": round(t_open, 3),
                   "batch_ms": round((time.perf_counter() - t2) / 50 * 1e3, 3),
                   "anon_added_mb": round((rss() - base) / 2**20, 1),
                   "file_added_mb": round((rss("RssFile") - base_file) / 2**20, 1)}
out["rss_mb"] = round(rss("VmRSS") / 2**20, 1)
print(json.dumps(out))
"""


ROWS_SCRIPT = r"""
import json, sys, time
from elflow.data.batches import Batches
from elflow.space import build_space
from elflow.data.datasets import build_dataset
def rss(key="RssAnon"):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
space = build_space({"kind": "tokens", "of": {"kind": "hf", "name": "minilm"}})
base = rss()
t = time.perf_counter()
train, val = build_dataset(sys.argv[1], space, int(sys.argv[2]), val_fraction=0.0005, seed=0)
t_split = time.perf_counter() - t
after_split = rss()
batches = Batches(train, 64, seed=0)
next(batches)
print(json.dumps({"rows": len(train) + len(val), "split_s": round(t_split, 2),
                  "split_and_first_batch_s": round(time.perf_counter() - t, 2),
                  "anon_after_split_mb": round((after_split - base) / 2**20, 1),
                  "anon_after_first_batch_mb": round((rss() - base) / 2**20, 1),
                  "peak_mb": round(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024, 1)}))
"""


def rows(args) -> None:
    """Open a store at a short L, for many rows: the split's and the permutation's cost per row."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    store = Path(args.dir) / args.store
    m = measure([sys.executable, "-c", ROWS_SCRIPT, str(store), str(args.length)], env)
    record({"what": "rows", "store": store.name, "length": args.length, **json.loads(m["stdout"]),
            "wall_s": m["wall_s"], **conditions()})


def record(rec: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec))


def run(args) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # one thread per process: CPU time = cores used
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    for size_text in args.sizes:
        size = parse_size(size_text)
        corpus = write_corpus(folder / f"corpus-{size_text}.{'txt' if args.text else 'jsonl'}", size, args.text)
        for workers in args.workers:
            store = folder / f"store-{size_text}{'-txt' if args.text else ''}-w{workers}"
            cmd = ["elflow", "prepare", str(corpus), "--space", "minilm", "--out", str(store), "--workers",
                   str(workers), "--quiet", "--overwrite"]
            m = measure(cmd, env)
            manifest = json.loads((store / "manifest.json").read_text())
            tokens = manifest["tokens"]
            store_bytes = sum(manifest["bytes"].values())
            main_cpu = manifest["build"]["main_cpu_seconds"]
            rec = {"what": "prepare", "corpus": corpus.name, "corpus_bytes": corpus.stat().st_size,
                   "documents": manifest["records"], "tokens": tokens, "workers": workers,
                   "store_bytes": store_bytes, "bytes_per_token": round(store_bytes / tokens, 4),
                   "tokens_per_s": round(tokens / m["wall_s"]),
                   "tokens_per_cpu_s": round(tokens / max(m["cpu_s"], 1e-9)),
                   "main_cpu_s": main_cpu, **{k: v for k, v in m.items() if k != "stdout"}, **conditions()}
            record(rec)
            measure_store(folder, store, tokens, env)
            if args.delete:
                import shutil

                shutil.rmtree(store, ignore_errors=True)
                shutil.rmtree(folder / f"run-{store.name}", ignore_errors=True)
        if args.delete:
            corpus.unlink()


def measure_store(folder: Path, store: Path, tokens: int, env) -> None:
    """Open a store as training does, then start a one-step training on it."""
    opened = measure([sys.executable, "-c", OPEN_SCRIPT, str(store)], env)
    record({"what": "open", "store": store.name, "tokens": tokens, **json.loads(opened["stdout"]),
            "wall_s": opened["wall_s"], "peak_rss_mb": opened["peak_main_rss_mb"], **conditions()})
    run_dir = folder / f"run-{store.name}"
    started = measure(["elflow", "train", "--defaults", "quickstart", "--data", str(store), "--steps", "1",
                       "--sample-every", "0", "--out", str(run_dir), "--overwrite", "--quiet",
                       "--device", "cpu"], env)
    record({"what": "train_start", "store": store.name, "tokens": tokens, "wall_s": started["wall_s"],
            "cpu_s": started["cpu_s"], "peak_rss_mb": started["peak_main_rss_mb"],
            "peak_anon_mb": started["peak_tree_anon_mb"], "load_before": started["load_before"],
            **conditions()})


def reopen(args) -> None:
    """`measure_store` again for stores already in --dir (named store-*)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    folder = Path(args.dir)
    for name in args.stores:
        store = folder / name
        tokens = json.loads((store / "manifest.json").read_text())["tokens"]
        measure_store(folder, store, tokens, env)


def report(args) -> None:
    """The tables of RESULTS.md, from the last record of each kind per corpus / store."""
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    last = {}
    for r in rows:
        last[(r["what"], r.get("corpus"), r.get("store"), r.get("workers"))] = r
    print("| corpus | documents | tokens | workers | wall | CPU, all processes | tokens per CPU-second | peak RSS: all "
          "processes (main) | bytes per token | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in (v for k, v in last.items() if k[0] == "prepare"):
        print(f"| {r['corpus']} ({r['corpus_bytes'] / 1e6:,.0f} MB) | {r['documents']:,} | {r['tokens'] / 1e6:,.1f}M "
              f"| {r['workers']} | {r['wall_s']:,.0f} s | {r['cpu_s']:,.0f} s | {r['tokens_per_cpu_s'] / 1e3:,.0f}k "
              f"| {r['peak_tree_rss_mb'] / 1024:.2f} ({r['peak_main_rss_mb'] / 1024:.2f}) GB "
              f"| {r['bytes_per_token']:.3f} | {r['load_before'][0]:.1f}-{r['load_after'][0]:.1f} |")
    print()
    print("| store | rows at L = 1024 (packed / document) | open + split + first batch | memory added: anonymous "
          "(mapped store pages) | batch of 64 x 1024 | `train --steps 1`: wall, CPU, peak RSS (anonymous) "
          "| load average |")
    print("|---|---|---|---|---|---|---|")
    starts = {k[2]: v for k, v in last.items() if k[0] == "train_start"}
    for r in (v for k, v in last.items() if k[0] == "open"):
        s = starts.get(r["store"], {})
        p, d = r["packed"], r.get("document")

        def both(key, fmt, unit=""):
            return f"{fmt.format(p[key])}" + (f" / {fmt.format(d[key])}" if d else "") + unit

        mem = (f"{p['anon_added_mb']:.0f} ({p['file_added_mb']:.0f})"
               + (f" / {d['anon_added_mb']:.0f} ({d['file_added_mb']:.0f})" if d else "") + " MB")
        print(f"| {r['store']} | {both('rows', '{:,}')} | {both('open_split_first_batch_s', '{:.2f}', ' s')} "
              f"| {mem} | {both('batch_ms', '{:.1f}', ' ms')} | {s.get('wall_s', float('nan')):.0f} s, "
              f"{s.get('cpu_s', float('nan')):.0f} s, {s.get('peak_rss_mb', float('nan')) / 1024:.2f} "
              f"({s.get('peak_anon_mb', float('nan')) / 1024:.2f}) GB | {r['load'][0]:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="generate corpora, prepare them, open them, start a training on each")
    r.add_argument("--sizes", nargs="+", default=["10M", "100M", "1G"], help="corpus sizes (default: 10M 100M 1G)")
    r.add_argument("--workers", nargs="+", type=int, default=[2], help="--workers values to measure (default: 2)")
    r.add_argument("--dir", default=".bench", help="where corpora and stores are written (default: .bench)")
    r.add_argument("--text", action="store_true", help="one .txt file (a single document) instead of a .jsonl")
    r.add_argument("--delete", action="store_true", help="delete each corpus and store once measured")
    o = sub.add_parser("reopen", help="open stores already prepared and start a training on each")
    o.add_argument("stores", nargs="+", help="store folder names inside --dir")
    o.add_argument("--dir", default=".bench", help="where the stores are (default: .bench)")
    w = sub.add_parser("rows", help="the cost per row of a store's split and batch permutation, at a short L")
    w.add_argument("store", help="a store folder name inside --dir")
    w.add_argument("--length", type=int, default=128, help="the row length (default: 128)")
    w.add_argument("--dir", default=".bench", help="where the store is (default: .bench)")
    sub.add_parser("report", help="print the tables of benchmarks/results/data_scale.jsonl")
    args = p.parse_args()
    {"run": run, "reopen": reopen, "rows": rows, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
