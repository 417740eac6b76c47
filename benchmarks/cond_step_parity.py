"""elflow's conditional training step against a re-implementation of the released one, term by term
(benchmarks/RESULTS.md, section 12).

Both steps run on the same batch, the same weights and the same draws (one `flow.draw_training_noise` draw
with the decode branch on); the released step is `tests/authors_cond_step.py`, written from the published
semantics and sharing no code with elflow's loss or optimiser. Compared, in the order the step computes
them, each as the largest absolute difference (and, for tensors, relative to the largest entry):

    inputs    the trained pass's z, self-conditioning slot, t, omega and mode gate, on denoise and decode rows
    outputs   x_pred on denoise rows, logits on decode rows
    terms     per-token v-MSE (denoise rows) and cross-entropy (decode rows) at the scored positions
    loss      the step's loss
    grads     the gradient of every parameter, by optimiser group (Muon: 2-D, Adam: the rest)
    update    the first optimiser step of every parameter from the same gradient (elflow's default update
              against the released optimiser re-written in tests/authors_cond_step.py; lr 1e-3; see
              `elflow_updates`), Muon and Adam groups both, with the ratio of the two steps' norms

The first term whose relative difference exceeds its tolerance is printed as the first difference: 1e-4 for
every term up to the gradients (fp32 against fp32, the same operations in other orders), 1e-3 for the
steps (five fp32 Newton-Schulz iterations amplify rounding in a matrix's small singular directions: two
evaluations of the same step, an `addmm` chain and a plain one, differ by up to 2e-4 here; an Adam step of
1e-3 read as the difference of two fp32 weights near 1 keeps about 1e-4 of it).

    PYTHONPATH=src python benchmarks/cond_step_parity.py            # the demo network, L 48, source 24, B 32
    PYTHONPATH=src python benchmarks/cond_step_parity.py --quick    # the tiny network, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from authors_cond_step import authors_cond_loss, released_first_step  # noqa: E402

from elflow import flow  # noqa: E402
from elflow.flow import Recipe, draw_training_noise, elf_loss
from elflow.model import ELF, get_config
from elflow.optim import ELFOptimizer

TOL = 1e-4
TOL_UPDATE = 1e-3
LR = 1e-3


def build(quick: bool, seed: int):
    """(net, x, tokens, known, valid): a network with a non-zero x head and a batch of pairs whose sources
    take 24 of 48 positions (the quickstart's conditional layout), their lengths varying by row."""
    torch.manual_seed(seed)
    cfg = get_config("tiny") if quick else get_config("demo")
    B, L, S = (8, 16, 6) if quick else (32, 48, 24)
    net = ELF(cfg)
    torch.nn.init.normal_(net.x_head.weight, std=0.02)  # it starts at zero; a trained one is not
    x = torch.randn(B, L, cfg.dim)
    tokens = torch.randint(0, cfg.vocab_size, (B, L))
    src = torch.randint(S // 2, S + 1, (B,))
    known = torch.arange(L)[None, :] < src[:, None]
    return net, x, tokens, known, torch.ones(B, L, dtype=torch.bool)


def draw(shape, recipe, seed: int):
    """A conditional draw with decode, self-conditioned, plain denoise and source-dropped rows."""
    for s in range(seed, seed + 1000):
        d = draw_training_noise(shape, recipe, generator=torch.Generator().manual_seed(s),
                                cpu_generator=torch.Generator().manual_seed(s + 1), conditional=True)
        if d.decode.any() and d.self_cond.any() and d.drop_source.any() and (~d.decode & ~d.self_cond).any():
            return d
    raise RuntimeError("no draw with every kind of row")


def elflow_terms(net, x, tokens, known, valid, d, recipe):
    """elflow's loss and the terms it computes on the way, captured where elf_loss hands them on."""
    rec = {}

    def trained(z, t, omega, slot, gate, rows):
        rec.update(z=z, t=t, omega=omega, slot=slot, gate=gate, rows=rows)
        x_pred, logits = net.mixed(z, t, omega, slot, gate, rows)
        rec.update(x_pred=x_pred, logits=logits)
        return x_pred, logits

    inner = flow.token_mean_loss

    def spy(err, logits, tokens_, is_dec, dec, w):
        rec.update(mse=err, ce=flow.token_nll(logits, tokens_[dec]), scored=w)
        return inner(err, logits, tokens_, is_dec, dec, w)

    flow.token_mean_loss = spy
    try:
        loss, _ = elf_loss(net, x, tokens, d, recipe, valid=valid, known=known, trained=trained)
    finally:
        flow.token_mean_loss = inner
    return loss, rec


def gradients(net, loss):
    net.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in net.named_parameters()}


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.detach().float(), b.detach().float()
    abs_ = (a - b).abs().max().item() if a.numel() else 0.0
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30) if a.numel() else 1.0
    return {"abs": abs_, "rel": abs_ / scale}


def elflow_updates(net, grads):
    """The first step of elflow's optimiser (ELFOptimizer's default update, Newton-Schulz iterated in fp32 as
    the released optimiser runs it) from `grads`: {name: before - after} for every parameter.
    The gradients are not clipped: clipping scales them all by one factor, to which Muon's step is blind but
    for its eps (1e-7 on the norm of a matrix, a share 1e-3 of the smallest clipped norms here, which Newton-
    Schulz then amplifies in the small singular directions), so a clipped comparison would measure the two
    eps conventions instead of the step."""
    for n, p in net.named_parameters():
        p.grad = grads[n].clone()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = ELFOptimizer(list(net.named_parameters()), lr=LR, ns_method="iterate")
    opt.step()
    out = {n: before[n] - p.detach() for n, p in net.named_parameters()}
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(before[n])
    return out


def compare(quick: bool, seed: int) -> dict:
    recipe = Recipe(decode_noise_scale=1.0, source_drop_prob=0.1)
    net, x, tokens, known, valid = build(quick, seed)
    d = draw(x.shape, recipe, seed)
    dec, den = d.decode, ~d.decode
    rows = []

    def add(term, a, b):
        rows.append({"term": term, **diff(a, b)})

    loss_e, e = elflow_terms(net, x, tokens, known, valid, d, recipe)
    a = {}
    loss_a = authors_cond_loss(net, x, tokens, known, d, recipe, valid=valid, record=a)
    for branch, m in (("denoise", den), ("decode", dec)):
        for k in ("z", "slot"):
            add(f"input {k} ({branch} rows)", e[k][m], a[k][m])
        for k in ("t", "omega", "gate"):
            add(f"input {k} ({branch} rows)", e[k][m], a[k][m])
    add("x_pred (denoise rows)", e["x_pred"][den], a["x_pred"][den])
    add("logits (decode rows)", e["logits"], a["logits"][dec])
    w = a["scored"].bool()
    add("v-MSE per token (denoise rows, scored)", e["mse"][den][w[den]], a["mse"][den][w[den]])
    add("CE per token (decode rows, scored)", e["ce"][w[dec]], a["ce"][dec][w[dec]])
    add("scored positions", e["scored"], a["scored"])
    add("loss", loss_e, loss_a)

    g_e, g_a = gradients(net, loss_e), gradients(net, loss_a)
    opt = ELFOptimizer(list(net.named_parameters()), lr=LR)
    for group, names in (("Muon", opt.muon_names), ("Adam", opt.adam_names)):
        for n in names:
            add(f"grad [{group}] {n}", g_e[n], g_a[n])

    upd_e = elflow_updates(net, g_e)
    for group, names in (("Muon", opt.muon_names), ("Adam", opt.adam_names)):
        for n in names:
            upd_a = released_first_step(n, g_e[n], LR)  # the same gradient: the optimiser alone
            r = diff(upd_e[n], upd_a)
            ratio = (upd_e[n].norm() / upd_a.norm()).item()
            rows.append({"term": f"update [{group}] {n}", **r, "norm_ratio": ratio, "tol": TOL_UPDATE})

    first = next((r for r in rows if r["rel"] > r.get("tol", TOL)), None)
    return {"quick": quick, "seed": seed, "rows": d.decode.numel(), "decode_rows": int(dec.sum()),
            "self_cond_rows": int(d.self_cond.sum()), "dropped_rows": int(d.drop_source.sum()),
            "tolerance": TOL, "first_difference": first, "terms": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny network (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the comparison as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    res = compare(args.quick, args.seed)
    print(f"rows {res['rows']}: {res['decode_rows']} decode, {res['self_cond_rows']} self-conditioned, "
          f"{res['dropped_rows']} with the source dropped")
    for r in res["terms"]:
        ratio = f"  norm ratio elflow/released {r['norm_ratio']:.4f}" if "norm_ratio" in r else ""
        flag = "  <-- differs" if r["rel"] > r.get("tol", TOL) else ""
        print(f"  {r['term']:<58} abs {r['abs']:.2e}  rel {r['rel']:.2e}{ratio}{flag}")
    f = res["first_difference"]
    print("first difference:", "none" if f is None else f"{f['term']} (abs {f['abs']:.3g}, rel {f['rel']:.3g})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
