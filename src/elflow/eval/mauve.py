"""MAUVE (Pillutla et al., 2021) between two sets of texts, on the features of a causal-LM judge.

Each text is featurised as the MAUVE paper does with GPT-2 Large: the judge's last-layer hidden state at the
text's last token (no special tokens added, truncated to the judge's context). `mauve-text` then quantises both
sets together (l2-normalised, PCA to 90% of the variance, k-means into `clusters` buckets) and integrates the
divergence curve of the two histograms: near 1 when the judge cannot tell the sets apart, near 0 when it can.

    judge_features(texts, model, tokenizer)          -> (N, H) fp32 features on the model's device
    mauve_from_features(p_features, q_features)      -> {"mauve", "mauve_star", "frontier_integral", "clusters", ...}
    mauve_score(p_texts, q_texts, model, tokenizer)  -> the same plus "featurizer" and "max_length"
    mauve_against(references, model, tokenizer)      -> texts -> {"mauve", "mauve_settings"}: one reference set,
                                                        featurised once, against many sample sets
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import torch

from elflow.eval.metrics import judge_context
from elflow.util.errors import ELFError, first_line

__all__ = ["MIN_TEXTS", "clusters_for", "judge_features", "mauve_from_features", "mauve_score", "mauve_against"]

MIN_TEXTS = 10  # per side; also at least 2 texts per cluster on average, or the histograms are mostly empty


def _max_length(max_length, model, tokenizer) -> int:
    """The judge tokens kept per text: `max_length` (at least 1), else the judge's context."""
    if max_length is None:
        return judge_context(model, tokenizer)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ELFError(f"max_length must be an integer >= 1 (judge tokens kept per text), got {max_length!r}")
    return max_length


def _texts(texts, name: str) -> list[str]:
    if isinstance(texts, str):
        raise ELFError(f"{name} is a single string; pass a list of texts")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ELFError(f"{name}[{i}] is a {type(t).__name__}, not a string; pass a list of texts")
    return texts


@torch.no_grad()
def judge_features(texts, model, tokenizer, batch_size: int = 8, max_length: int | None = None) -> torch.Tensor:
    """(N, H) fp32 on the model's device: the last-layer hidden state at each text's last token.

    Texts are tokenised without special tokens and cut to `max_length` (default: the judge's context), then
    judged in batches of similar length, right-padded (pad = the tokenizer's pad, else EOS) with an attention
    mask; under causal attention the padding cannot change a row's last real position. The LM head is not run
    (`model.base_model` gives the same final-norm hidden state as `output_hidden_states[-1]`)."""
    texts = _texts(texts, "texts")
    if not texts:
        raise ELFError("no texts to featurise")
    if batch_size < 1:
        raise ELFError(f"batch size must be at least 1, got {batch_size}")
    max_length = _max_length(max_length, model, tokenizer)
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    for i, (text, ids) in enumerate(zip(texts, encoded)):
        if not ids:
            raise ELFError(f"text {i} is {'empty' if not text else 'no tokens to the judge tokenizer'}: MAUVE "
                           "featurises a text by its last token; drop or fill the empty texts first")
    seqs = [torch.tensor(ids[:max_length], dtype=torch.long) for ids in encoded]
    lengths = torch.tensor([len(s) for s in seqs])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    order = torch.argsort(lengths, descending=True, stable=True)  # similar lengths together: less padding
    was_training = model.training
    model.eval()
    try:
        chunks = []
        for start in range(0, len(seqs), batch_size):
            idx = order[start:start + batch_size]
            ids = torch.nn.utils.rnn.pad_sequence([seqs[i] for i in idx], batch_first=True,
                                                  padding_value=pad or 0).to(device)  # (b, width)
            mask = (torch.arange(ids.shape[1])[None, :] < lengths[idx][:, None]).long().to(device)
            hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state  # (b, width, H)
            last = (lengths[idx] - 1).to(device)
            chunks.append(hidden[torch.arange(len(idx), device=device), last].float())  # (b, H)
    finally:
        model.train(was_training)
    feats = torch.cat(chunks)
    out = torch.empty_like(feats)
    out[order.to(device)] = feats
    return out


@contextlib.contextmanager
def _quiet_native_stderr():
    """File descriptor 2 pointed at /dev/null for the block (what native libraries print), then restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _mauve_package():
    try:
        import mauve
    except ImportError as e:
        raise ELFError(f"MAUVE needs the mauve-text package, which cannot be imported ({first_line(e)}): "
                       "pip install mauve-text") from None
    return mauve


def clusters_for(n_p: int, n_q: int, num_buckets) -> int:
    """The k-means clusters for n_p and n_q texts; ELFError when there are too few texts for them."""
    if num_buckets == "auto":
        clusters = max(2, round(min(n_p, n_q) / 10))
    elif isinstance(num_buckets, int) and not isinstance(num_buckets, bool) and num_buckets >= 2:
        clusters = num_buckets
    else:
        raise ELFError(f"num_buckets must be 'auto' or an integer of at least 2, got {num_buckets!r}")
    need = max(MIN_TEXTS, 2 * clusters)
    if min(n_p, n_q) < need:
        raise ELFError(f"MAUVE with {clusters} clusters needs at least {need} texts a side, got {n_p} and {n_q}: "
                       "pass more texts (a few hundred a side is usual) or fewer clusters (--mauve-clusters)")
    return clusters


CURVE_POINTS = 25  # mixture weights on the divergence curve (mauve-text's default)
SCALING = 5  # the constant c of exp(-c KL) (mauve-text's default)


def curve_area(curve) -> float:
    """MAUVE from a divergence curve ((m, 2) points exp(-c KL(Q|R)), exp(-c KL(P|R)) with R running from Q to P):
    mauve-text's formula, the mean of the area under the curve integrated along x and along y after sorting
    the points by that axis, with points that tie on the axis taken in their order along the curve (the other
    coordinate descending), and at most 1.

    mauve-text sorts by one axis with an unstable sort. Where the two histograms are equal, every point between
    the two end points is exactly (1, 1), they tie with the end point (1, 0) on x (and (0, 1) on y), and the
    sort may put the end point first: 20 copies of one text against themselves then score 0.75 (a quarter of the
    square cut off), on features where every text falls in one cluster. Ordered along the curve the same points
    enclose the whole square: 1. Without ties the order, and so the score, is mauve-text's own; the bound at 1
    removes a float rounding above it (1.0000000000000002)."""
    from sklearn.metrics import auc

    points = np.asarray(curve, dtype=np.float64)
    x, y = points[:, 0], points[:, 1]
    along_x = np.lexsort((-y, x))  # x ascending; a tie: the higher y first, as the curve runs
    along_y = np.lexsort((-x, y))
    return float(min(1.0, 0.5 * (auc(x[along_x], y[along_x]) + auc(y[along_y], x[along_y]))))


def _smoothed_curve(out, n_p: int, n_q: int):
    """The divergence curve of the Krichevsky-Trofimov-smoothed histograms (MAUVE*), as mauve-text builds it:
    the cluster counts (recovered from its histograms) plus 0.5, normalised."""
    from mauve.compute_mauve import get_divergence_curve_for_multinomials

    p_counts, q_counts = np.rint(out.p_hist * n_p), np.rint(out.q_hist * n_q)
    p_s, q_s = (p_counts + 0.5) / (p_counts + 0.5).sum(), (q_counts + 0.5) / (q_counts + 0.5).sum()
    weights = np.linspace(1e-6, 1 - 1e-6, CURVE_POINTS)
    return get_divergence_curve_for_multinomials(p_s, q_s, weights, SCALING)


def mauve_from_features(p_features, q_features, *, num_buckets: int | str = "auto", seed: int = 25,
                        kmeans_num_redo: int = 5, kmeans_max_iter: int = 500, threads: int | None = None) -> dict:
    """MAUVE of two (n, H) feature sets with mauve-text: its quantisation and divergence curve, integrated by
    `curve_area` (mauve-text's number wherever no points tie; two equal histograms score exactly 1).
    num_buckets: k-means clusters, "auto" = max(2, round(min(n_p, n_q) / 10)) as mauve-text's rule; seed fixes
    PCA and k-means (the same features and seed give the same score); threads: faiss's OpenMP threads for
    k-means (None: faiss's default, every core)."""
    p = np.asarray(torch.as_tensor(p_features).detach().float().cpu())
    q = np.asarray(torch.as_tensor(q_features).detach().float().cpu())
    if p.ndim != 2 or q.ndim != 2 or p.shape[1] != q.shape[1]:
        raise ELFError(f"p and q features must be (n, H) arrays of the same width, got shapes {p.shape} and "
                       f"{q.shape}; featurise both sets with the same judge")
    if not (np.isfinite(p).all() and np.isfinite(q).all()):
        raise ELFError("the features hold inf or nan; featurise the texts with a judge in fp32")
    clusters = clusters_for(len(p), len(q), num_buckets)
    if kmeans_num_redo < 1 or kmeans_max_iter < 1 or (threads is not None and threads < 1):
        raise ELFError("kmeans_num_redo, kmeans_max_iter and threads must be at least 1")
    mauve = _mauve_package()
    import faiss

    before = faiss.omp_get_max_threads()
    if threads is not None:
        faiss.omp_set_num_threads(int(threads))
    try:
        with _quiet_native_stderr():  # faiss warns from C++ on every call that n / 10 clusters is few points
            out = mauve.compute_mauve(p_features=p, q_features=q, num_buckets=clusters, seed=seed,
                                      kmeans_num_redo=kmeans_num_redo, kmeans_max_iter=kmeans_max_iter, verbose=False,
                                      divergence_curve_discretization_size=CURVE_POINTS,
                                      mauve_scaling_factor=SCALING)
    finally:
        faiss.omp_set_num_threads(before)
    # the same features (the same multiset of rows), or equal histograms: the curve is the corner (1, 1), the
    # area 1. The first is checked on the features, since PCA's SVD (before k-means) can round copies of one row
    # apart on some processors and so split equal sets into unequal histograms
    if same_rows(p, q) or np.array_equal(out.p_hist, out.q_hist):
        score = star = 1.0
    else:
        score, star = curve_area(out.divergence_curve), curve_area(_smoothed_curve(out, len(p), len(q)))
    return {"mauve": score, "mauve_star": star, "frontier_integral": float(out.frontier_integral),
            "texts": (len(p), len(q)),
            "clusters": int(out.num_buckets), "seed": seed, "kmeans_num_redo": kmeans_num_redo,
            "kmeans_max_iter": kmeans_max_iter}


def same_rows(p: np.ndarray, q: np.ndarray) -> bool:
    """Whether two (n, H) arrays hold the same rows, each as often, in any order."""
    return p.shape == q.shape and np.array_equal(p[np.lexsort(p.T[::-1])], q[np.lexsort(q.T[::-1])])


def mauve_score(p_texts, q_texts, model, tokenizer, *, num_buckets: int | str = "auto", seed: int = 25,
                batch_size: int = 8, max_length: int | None = None, kmeans_num_redo: int = 5,
                kmeans_max_iter: int = 500, threads: int | None = None) -> dict:
    """MAUVE of texts p (e.g. samples) against texts q (e.g. references), featurised by the judge `model`.

    Returns mauve (in (0, 1], higher = closer), mauve_star (the smoothed variant), frontier_integral, texts
    (n_p, n_q), clusters, seed, the k-means settings, featurizer (what the features are) and max_length."""
    p_texts, q_texts = _texts(p_texts, "p_texts"), _texts(q_texts, "q_texts")
    # too few texts and a missing package are reported before any text is featurised
    clusters_for(len(p_texts), len(q_texts), num_buckets)
    _mauve_package()
    max_length = _max_length(max_length, model, tokenizer)
    p = judge_features(p_texts, model, tokenizer, batch_size, max_length)
    q = judge_features(q_texts, model, tokenizer, batch_size, max_length)
    res = mauve_from_features(p, q, num_buckets=num_buckets, seed=seed, kmeans_num_redo=kmeans_num_redo,
                              kmeans_max_iter=kmeans_max_iter, threads=threads)
    return {**res, "featurizer": featurizer_name(model), "max_length": max_length}


def featurizer_name(model) -> str:
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    return f"{name}: last-layer hidden state at the last token"


def mauve_against(references, model, tokenizer, *, num_buckets: int | str = "auto", seed: int = 25,
                  batch_size: int = 8, max_length: int | None = None, threads: int | None = None):
    """A score for sample sets (elflow.eval.scoring.sample_and_score's `score`): texts -> {"mauve", and
    "mauve_settings": featurizer, texts (n samples, n references), clusters, seed, empty (samples skipped)}.
    The references are featurised once; empty texts (samples cut at a first EOS) are skipped on both sides."""
    given = _texts(references, "references")
    refs = [t for t in given if t.strip()]
    if not refs:
        raise ELFError(f"the references hold no text ({len(given)} given, every one empty); MAUVE compares the "
                       "samples with real texts")
    max_length = _max_length(max_length, model, tokenizer)
    q = judge_features(refs, model, tokenizer, batch_size, max_length)

    def score(texts) -> dict:
        texts = _texts(texts, "texts")
        kept = [t for t in texts if t.strip()]
        clusters_for(len(kept), len(refs), num_buckets)
        p = judge_features(kept, model, tokenizer, batch_size, max_length)
        res = mauve_from_features(p, q, num_buckets=num_buckets, seed=seed, threads=threads)
        return {"mauve": res["mauve"], "mauve_settings": {
            "featurizer": featurizer_name(model), "texts": [len(kept), len(refs)], "clusters": res["clusters"],
            "seed": seed, "empty": len(texts) - len(kept), "max_length": max_length}}

    return score
