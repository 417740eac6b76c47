"""Two tiny runs to read back with other code (run with the code under test on PYTHONPATH): a plain one and
one with the short-run options, 6 steps each in fp32, each also stopped at step 3 (NAME-full, NAME-part).
    python old_side.py CORPUS.txt OUT"""
import sys

from elflow.train import TrainConfig, train

corpus = sys.argv[1]; base = sys.argv[2]
common = dict(preset="tiny", data=corpus, space="random-table:minilm", length=16, batch=4, warmup=2, ema_decay=0.9,
              log_every=1, ckpt_every=3, keep=5, dtype="fp32", seed=1, steps=6,
              short_run={"skip": "gated", "time_scale": 1000.0, "head_modulation": True, "table_readout": 1.0})
for name in ("plain", "options"):
    kw = dict(common)
    if name == "plain":
        kw.pop("short_run")
    cfg = TrainConfig(**kw)
    train(cfg, f"{base}/{name}-full", quiet=True, cache_dir=f"{base}/cache")
    train(cfg, f"{base}/{name}-part", quiet=True, cache_dir=f"{base}/cache", stop_after=3)
