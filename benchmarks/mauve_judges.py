"""MAUVE (mauve-text) on the last hidden state of offline judges trained on the built-in corpus, for texts
that are and are not like held-out text, with generative perplexity beside it.

Judges: the default JudgeConfig trained `--steps` steps each (`train_judge`, seed 0, the built-in corpus with
every 10th work held out). Texts, `--num` a side of `--words` words, all cut from the held-out works:
  heldout   consecutive words of held-out text (half A), scored against the other half B (the reference)
  uniform   words drawn uniformly from the held-out text's vocabulary (its distinct whitespace words)
  repeat    a 3-word phrase of the 10 most frequent held-out words, looped (a different phrase per text)
  the       "the" repeated (one text, `--num` times)
  shuffled  the texts of half A with their words shuffled within each text
Every set is scored against half B with k-means seeds 0..4 (the spread is k-means', the features are fixed).
One JSON object goes to benchmarks/results/mauve.json.

    python benchmarks/mauve_judges.py --judges runs/mauve-judges    # about 15 minutes on 2 busy cores
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path


def texts_from_heldout(held: list[str], num: int, words: int, seed: int) -> dict[str, list[str]]:
    """The sets of the module doc, from the held-out documents."""
    rng = random.Random(seed)
    flat = " ".join(held).split()
    chunks = [" ".join(flat[i:i + words]) for i in range(0, len(flat) - words + 1, words)]
    if len(chunks) < 2 * num:
        sys.exit(f"only {len(chunks)} texts of {words} words in the held-out text; need {2 * num}")
    rng.shuffle(chunks)
    a, b = chunks[:num], chunks[num:2 * num]
    vocab = sorted(set(flat))
    top = [w for w, _ in collections.Counter(flat).most_common(10)]
    return {
        "reference": b,
        "heldout": a,
        "uniform": [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(num)],
        "repeat": [" ".join((rng.sample(top, 3) * words)[:words]) for _ in range(num)],
        "the": [" ".join(["the"] * words)] * num,
        "shuffled": [" ".join(rng.sample(t.split(), len(t.split()))) for t in a],
    }


def trained_judge(folder: Path, steps: int) -> dict:
    """The judge in `folder` if it was trained `steps` steps, else train it there; returns its info."""
    from elflow.eval.judge import train_judge

    info_file = folder / "elflow_judge.json"
    if info_file.is_file():
        info = json.loads(info_file.read_text())
        if info.get("steps") == steps and info.get("data") == "builtin" and info.get("seed") == 0:
            return {k: v for k, v in info.items() if k not in ("note", "config")}
    return train_judge(folder, steps=steps, seed=0, progress=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--judges", default="runs/mauve-judges", help="folder of the judges (trained when missing)")
    ap.add_argument("--steps", type=int, nargs="+", default=[80, 250], help="training steps of each judge")
    ap.add_argument("--num", type=int, default=250, help="texts a side")
    ap.add_argument("--words", type=int, default=48, help="words a text")
    ap.add_argument("--seed", type=int, default=0, help="seed of the texts")
    ap.add_argument("--kmeans-seeds", type=int, default=5, help="MAUVE seeds 0..N-1 for each set")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default="benchmarks/results/mauve.json")
    args = ap.parse_args(argv)
    from importlib.metadata import version

    import faiss
    import numpy as np
    import torch

    from elflow.data.corpus import read_documents
    from elflow.eval.judge import load_judge, split_documents
    from elflow.eval.mauve import judge_features, mauve_from_features
    from elflow.eval.metrics import generative_perplexity
    from elflow.util.files import atomic_write_json

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    _, held = split_documents(read_documents("builtin"), 10)  # the works `train_judge` holds out
    sets = texts_from_heldout(held, args.num, args.words, args.seed)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    result = {"cpu": cpu, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
              "torch_threads": torch.get_num_threads(), "faiss_threads": faiss.omp_get_max_threads(),
              "python": platform.python_version(), "torch": torch.__version__, "mauve_text": version("mauve-text"),
              "faiss": faiss.__version__, "texts_a_side": args.num, "words": args.words, "text_seed": args.seed,
              "heldout_works": len(held), "command": "python benchmarks/mauve_judges.py " + " ".join(argv or sys.argv[1:]),
              "judges": []}
    for steps in args.steps:
        t0 = time.time()
        info = trained_judge(Path(args.judges) / f"judge-{steps}", steps)
        model, tok = load_judge(Path(args.judges) / f"judge-{steps}", device="cpu")
        row = {"steps": steps, "train_seconds": info["seconds"], "heldout_perplexity": info["heldout_perplexity"],
               "sets": {}}
        t1 = time.time()
        feats = {name: judge_features(texts, model, tok) for name, texts in sets.items()}
        row["featurise_seconds_per_set"] = (time.time() - t1) / len(sets)
        for name, texts in sets.items():
            if name == "reference":
                continue
            t2 = time.time()
            runs = [mauve_from_features(feats[name], feats["reference"], seed=s) for s in range(args.kmeans_seeds)]
            seconds = (time.time() - t2) / len(runs)
            scores = np.array([r["mauve"] for r in runs])
            row["sets"][name] = {"mauve": scores.tolist(), "mean": float(scores.mean()), "std": float(scores.std()),
                                 "mauve_star_mean": float(np.mean([r["mauve_star"] for r in runs])),
                                 "clusters": runs[0]["clusters"], "mauve_seconds": seconds,
                                 "gen_ppl": generative_perplexity(texts, model, tok)["gen_ppl"]}
        row["reference_gen_ppl"] = generative_perplexity(sets["reference"], model, tok)["gen_ppl"]
        # the same features and seed give the same score; and with one faiss thread?
        again = mauve_from_features(feats["heldout"], feats["reference"], seed=0)["mauve"]
        one = mauve_from_features(feats["heldout"], feats["reference"], seed=0, threads=1)["mauve"]
        row["repeat_same_seed_equal"] = again == row["sets"]["heldout"]["mauve"][0]
        row["one_faiss_thread_equal"] = one == row["sets"]["heldout"]["mauve"][0]
        row["seconds"] = time.time() - t0
        result["judges"].append(row)
        print(json.dumps({"steps": steps, **{k: round(v["mean"], 3) for k, v in row["sets"].items()}}), flush=True)
    result["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
