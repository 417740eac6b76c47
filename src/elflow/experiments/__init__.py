"""Experiments built on the library: the quickstart, the paper's claims at small scale, comparisons with the
baselines, sweeps, the toy and schedule figures, the benchmark, a T5 encoder from scratch, the viewer."""
