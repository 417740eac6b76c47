"""`elflow claims`: the verdict rule on synthetic seed figures, claim selection, and a tiny report end to end
(cached, resumable)."""

import json

import pytest

from elflow.experiments.claims import (
    CLAIMS,
    NAMES,
    Claim,
    Finding,
    Variant,
    claim_verdict,
    finding_verdict,
    run_claims,
    select_claims,
)
from elflow.util.errors import ELFError


def test_the_verdict_rule_on_synthetic_seed_figures():
    """Paired seed differences against 2 standard errors: a clear gap in the paper's direction agrees, the
    reverse disagrees, a gap smaller than the seeds' spread is within noise, one seed never decides; "higher is
    better" flips the sign; a "matches" finding agrees unless A is clearly worse."""
    base = [10.0, 12.0, 11.0, 13.0]
    assert finding_verdict([b - 2.0 for b in base], base)["verdict"] == "agrees"  # A lower by 2 on every seed
    assert finding_verdict([b + 2.0 for b in base], base)["verdict"] == "disagrees"
    noisy = [b + d for b, d in zip(base, (-1.0, 1.2, -0.9, 0.8))]  # mean gap 0.025, spread ~1
    res = finding_verdict(noisy, base)
    assert res["verdict"] == "within noise" and res["mean"] == pytest.approx(-0.025) and res["seeds"] == 4
    assert finding_verdict([9.0], [10.0])["verdict"] == "within noise"  # a single seed has no spread
    assert finding_verdict([b + 2.0 for b in base], base, better="higher")["verdict"] == "agrees"
    assert finding_verdict(noisy, base, kind="matches")["verdict"] == "agrees"
    assert finding_verdict([b + 2.0 for b in base], base, kind="matches")["verdict"] == "disagrees"
    # the spread is the paired differences', not the figures': a shared seed effect does not hide a steady gap
    shared = [1.0, 50.0, 100.0]
    assert finding_verdict([s - 0.5 for s in shared], shared)["verdict"] == "agrees"
    assert finding_verdict([1.0, float("nan")], [2.0, 3.0])["verdict"] == "within noise"
    assert claim_verdict(["agrees", "agrees"]) == "agrees"
    assert claim_verdict(["agrees", "within noise"]) == "within noise"
    assert claim_verdict(["agrees", "disagrees", "within noise"]) == "disagrees"


def test_claims_are_chosen_by_name_and_an_unknown_one_lists_the_known(capsys):
    from elflow.cli import main

    assert [c.name for c in select_claims(["omega,grid"])] == ["grid", "omega"]
    assert [c.name for c in select_claims(quick=True)] == ["sampler", "grid", "omega", "optimizer"]
    assert len(select_claims()) == len(CLAIMS) == 10
    for claim in CLAIMS:  # every finding compares two of the claim's own variants
        names = {v.name for v in claim.variants}
        assert all(f.a in names and f.b in names for f in claim.findings), claim.name
    with pytest.raises(ELFError, match="the claims are: " + ", ".join(NAMES)):
        select_claims(["omega", "nope"])
    assert main(["claims", "--only", "nope", "--out", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown claim 'nope'" in err[0] and "optimizer" in err[0]


@pytest.mark.slow
def test_a_tiny_report_end_to_end_is_cached_and_resumes(tmp_path, tiny_corpus_file, monkeypatch):
    """Two variants of the tiny network (prefix tokens, adaLN-Zero) and two sampler settings of one of them,
    2 seeds, 2 steps each: the report has every figure per seed, a verdict per finding and claim, claims.md
    and a plot per claim; a rerun trains nothing and measures nothing again."""
    claims = [
        Claim("net", "tokens vs adaln", "prefix tokens match adaLN", (Variant("tokens"), Variant(
            "adaln", {"network": {"conditioning": "adaln"}, "short_run": {}})), (Finding("tokens", "adaln", "loss", kind="matches"),)),
        Claim("omega", "omega", "omega 3 lowers perplexity", (Variant("w1", sampling={"omega": 1.0, "steps": 2}),
                                                              Variant("w3", sampling={"omega": 3.0, "steps": 2})),
              (Finding("w3", "w1", "gen_ppl"),)),
    ]
    base = {"preset": "tiny", "data": str(tiny_corpus_file), "space": "random-table:minilm", "length": 16,
            "batch": 4, "warmup": 1, "dtype": "fp32", "short_run": {}, "log_every": 1}
    judge = {"steps": 3, "hidden": 32, "depth": 1, "heads": 2, "context": 32, "batch_size": 2}
    kw = dict(seeds=2, steps=2, num=3, base=base, cache_dir=tmp_path / "cache", device="cpu", judge_settings=judge,
              printer=lambda *a: None)
    report = run_claims(claims, tmp_path / "out", **kw)
    assert [c["claim"] for c in report["claims"]] == ["net", "omega"]
    for c in report["claims"]:
        assert c["verdict"] in ("agrees", "disagrees", "within noise")
        assert all(len(rows) == 2 and all(r["steps"] == 2 for r in rows) for rows in c["seeds"].values())
        assert (tmp_path / "out" / f"{c['claim']}.png").stat().st_size > 1000
    net = report["claims"][0]
    assert net["seeds"]["adaln"][0]["params"] > net["seeds"]["tokens"][0]["params"]
    assert net["seeds"]["tokens"][0]["loss"] != net["seeds"]["tokens"][1]["loss"]  # the seeds differ
    w = report["claims"][1]["seeds"]
    assert w["w1"][0]["loss"] == w["w3"][0]["loss"]  # one training, two sampler settings
    assert len(list((tmp_path / "out" / "variants").iterdir())) == 4  # 2 trainings x 2 seeds
    md = (tmp_path / "out" / "claims.md").read_text()
    assert "| tokens vs adaln | prefix tokens match adaLN |" in md
    assert "| MAUVE |" in md and all("mauve" in r for rows in net["seeds"].values() for r in rows)
    assert json.loads((tmp_path / "out" / "claims.json").read_text())["claims"][1]["findings"][0]["a"] == "w3"

    import elflow.experiments.claims as claims_module

    def refuse(*a, **k):
        raise AssertionError("a cached variant was computed again")

    monkeypatch.setattr(claims_module, "train", refuse)
    monkeypatch.setattr(claims_module, "sample_and_score", refuse)
    again = run_claims(claims, tmp_path / "out", **kw)
    assert again["claims"] == report["claims"]


def test_every_variant_of_every_claim_is_a_valid_run(tmp_path):
    """Each variant's training settings, built as the report builds them, pass the run checks (a learned table
    with the table readout, say, is refused here, before any training); the from-scratch encoder's variant
    is built with a stand-in folder."""
    from elflow.experiments.claims import Harness

    harness = Harness(tmp_path, {"data": "builtin"}, {"steps": 10}, 4, None, "cpu", True, lambda *_: None, None)
    harness.encoder_folder = lambda: tmp_path / "encoder"
    for claim in CLAIMS:
        for variant in claim.variants:
            cfg = harness.config(variant, 0)
            assert cfg.steps == 10, (claim.name, variant.name)
