"""`elflow claims`: the paper's ablation findings re-tested at small scale with seeds, each variant trained
once and cached, a verdict per finding and per claim."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from elflow.config import RUN_DEFAULTS, TrainConfig
from elflow.data.datasets import build_dataset
from elflow.eval.diagnostics import corpus_vocabulary, validation_report
from elflow.eval.judge import load_judge
from elflow.eval.mauve import MIN_TEXTS, mauve_against
from elflow.eval.scoring import sample_and_score
from elflow.experiments.compare import cached_judge, judge_texts, row_documents
from elflow.experiments.encoder_train import train_encoder
from elflow.lifecycle.outputs import check_out
from elflow.methods import get_method
from elflow.runs.load import load_for_sampling
from elflow.space import build_space, parse_space, tokenizer_spec
from elflow.train import train
from elflow.util import jsonio
from elflow.util.errors import ELFError
from elflow.util.files import FolderHold, atomic_write, atomic_write_json, read_json

NOISE = 2.0  # standard errors of the paired seed differences a finding must clear


DEFAULT_MINUTES = 1.5


DEFAULT_SEEDS = 3


QUICK = ("omega", "sampler", "grid", "optimizer")  # `--quick`: the base training and AdamW's, per seed


QUICK_SEEDS = 2


BUDGET_CAP = 1_000_000


FIGURES = {"loss": "held-out v-MSE", "decode_acc": "decode accuracy", "gen_ppl": "judge perplexity",
           "entropy": "token entropy", "corpus_words": "corpus words", "mauve": "MAUVE"}


@dataclass(frozen=True)
class Variant:
    """One arm of a claim: `train` (TrainConfig settings over the claims' base), `sampling` (sampler knobs)."""

    name: str
    train: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """The paper's finding that variant `a` is `better` than `b` on `figure` ("lower" or "higher" is better),
    or, with `kind="matches"`, no worse."""

    a: str
    b: str
    figure: str
    better: str = "lower"
    kind: str = "better"

    def describe(self) -> str:
        word = {"lower": "<", "higher": ">"}[self.better]
        return f"{self.a} {word if self.kind == 'better' else word + '='} {self.b} on {FIGURES[self.figure]}"


@dataclass(frozen=True)
class Claim:
    name: str
    title: str
    paper: str
    variants: tuple
    findings: tuple


# the base of every variant: the quickstart's settings (random table over MiniLM's tokenizer, the network's
# options for short runs); variants that change the space, the head or the conditioning drop the options that
# do not go with them
_OPTIONS = dict(RUN_DEFAULTS["quickstart"][0]["short_run"])


_PLAIN = {"short_run": {**_OPTIONS, "skip": "none"}}  # v and eps heads: no Gaussian skip


# no fixed table to read out by (an encoder, a trained table)
_NO_TABLE = {"short_run": {**_OPTIONS, "table_readout": 0.0}}


_ADALN = {"short_run": {**_OPTIONS, "head_modulation": False}}  # adaLN modulates the head itself


_FEW = {"steps": 8}


def _predict_variants():
    out = []
    for dim in (64, 256, 384):
        for target in ("x", "v", "eps"):
            out.append(Variant(f"{target}@{dim}", {**_PLAIN, "network": {"predict": target},
                                                           "space": {**parse_space("random-table:minilm"), "dim": dim}}))
    return tuple(out)


CLAIMS = (
    Claim("predict", "the prediction target across space widths",
          "x-prediction works at every width; v is competitive at the smallest and degrades above; eps fails at "
          "every width (D.1)", _predict_variants(),
          tuple(Finding(f"x@{d}", f"eps@{d}", "gen_ppl") for d in (64, 256, 384))
          + (Finding("v@64", "x@64", "gen_ppl", kind="matches"), Finding("x@384", "v@384", "gen_ppl"))),
    Claim("bottleneck", "bottleneck width 32 / 128 / 512",
          "128 balances 32 (lower perplexity, lower diversity) and 512 (the reverse)",
          (Variant("b32", {"network": {"bottleneck": 32}}), Variant("b128", {"network": {"bottleneck": 128}}),
           Variant("b512", {"network": {"bottleneck": 512}})),
          (Finding("b32", "b128", "gen_ppl"), Finding("b32", "b128", "entropy"),
           Finding("b512", "b128", "gen_ppl", "higher"), Finding("b512", "b128", "entropy", "higher"))),
    Claim("space", "the embedding space",
          "a contextual encoder beats the token table, a random table and a learned table (learned worst); an "
          "encoder trained from scratch comes close behind the pretrained one (Figure 5a)",
          (Variant("minilm", {**_NO_TABLE, "space": "minilm"}),
           Variant("t5-scratch", {**_NO_TABLE, "space": "t5:{encoder}"}),
           Variant("token-table", {"space": "token-table:minilm"}),
           Variant("random-table", {}), Variant("learned-table", {"space": "learned-table:minilm", **_NO_TABLE})),
          (Finding("minilm", "token-table", "gen_ppl"), Finding("minilm", "random-table", "gen_ppl"),
           Finding("minilm", "learned-table", "gen_ppl"), Finding("random-table", "learned-table", "gen_ppl"),
           Finding("minilm", "t5-scratch", "gen_ppl"), Finding("t5-scratch", "learned-table", "gen_ppl"))),
    Claim("decoder", "shared against separate decoder",
          "one network that denoises and decodes matches a separate decoder, with one training stage (Figure 5b)",
          (Variant("shared"), Variant("separate", {"network": {"decoder": "separate"}})),
          (Finding("shared", "separate", "gen_ppl", kind="matches"),
           Finding("shared", "separate", "decode_acc", "higher", kind="matches"))),
    Claim("sampler", "SDE against ODE at few steps; gamma",
          "at 8 steps the SDE sampler has lower perplexity than the ODE at slightly lower entropy; a larger gamma "
          "lowers both (Figure 5c, D.6)",
          (Variant("ode", sampling={**_FEW, "sampler": "ode"}), Variant("sde", sampling={**_FEW, "sampler": "sde"}),
           Variant("sde-g0.5", sampling={**_FEW, "sampler": "sde", "gamma": 0.5}),
           Variant("sde-g2.5", sampling={**_FEW, "sampler": "sde", "gamma": 2.5})),
          (Finding("sde", "ode", "gen_ppl"), Finding("sde", "ode", "entropy"),
           Finding("sde-g2.5", "sde-g0.5", "gen_ppl"), Finding("sde-g2.5", "sde-g0.5", "entropy"))),
    Claim("grid", "logit-normal against uniform time grid",
          "the logit-normal grid beats the uniform one, most at few steps (D.6)",
          (Variant("logit-normal@8", sampling={**_FEW, "grid": "logit_normal"}),
           Variant("uniform@8", sampling={**_FEW, "grid": "uniform"}),
           Variant("logit-normal@32", sampling={"steps": 32, "grid": "logit_normal"}),
           Variant("uniform@32", sampling={"steps": 32, "grid": "uniform"})),
          (Finding("logit-normal@8", "uniform@8", "gen_ppl"),
           Finding("logit-normal@32", "uniform@32", "gen_ppl", kind="matches"))),
    Claim("omega", "self-conditioning guidance omega 0.5 -> 3",
          "raising omega from 0.5 to 3 lowers perplexity and entropy together (Figure 3)",
          (Variant("omega0.5", sampling={"omega": 0.5}), Variant("omega3", sampling={"omega": 3.0})),
          (Finding("omega3", "omega0.5", "gen_ppl"), Finding("omega3", "omega0.5", "entropy"))),
    Claim("decode-share", "the decode branch's share of rows",
          "a denoiser share below 0.8 (decode above 0.2) hurts, most under SDE (D.3)",
          (Variant("decode0.2-sde"), Variant("decode0.4-sde", {"recipe": {"decode_prob": 0.4}}),
           Variant("decode0.2-ode", sampling={"sampler": "ode"}),
           Variant("decode0.4-ode", {"recipe": {"decode_prob": 0.4}}, {"sampler": "ode"})),
          (Finding("decode0.2-sde", "decode0.4-sde", "gen_ppl"),
           Finding("decode0.2-ode", "decode0.4-ode", "gen_ppl"))),
    Claim("conditioning", "prefix tokens against adaLN-Zero",
          "prefix tokens match or beat adaLN-Zero with fewer parameters (D.4)",
          (Variant("tokens"), Variant("adaln", {**_ADALN, "network": {"conditioning": "adaln"}})),
          (Finding("tokens", "adaln", "gen_ppl", kind="matches"), Finding("tokens", "adaln", "loss", kind="matches"))),
    Claim("optimizer", "Muon against AdamW",
          "Muon beats AdamW (D.5)",
          (Variant("muon"), Variant("adamw", {"optimizer": "adamw", "adam_heads": False, "lr": 1e-3})),
          (Finding("muon", "adamw", "loss"), Finding("muon", "adamw", "gen_ppl"))),
)


NAMES = tuple(c.name for c in CLAIMS)


# ----------------------------------------------------------------------------------------------------------
# the verdict
def _mean_std(values):
    k = len(values)
    m = sum(values) / k
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (k - 1)) if k > 1 else math.nan
    return m, s


def finding_verdict(a: list[float], b: list[float], better: str = "lower", kind: str = "better") -> dict:
    """The verdict of one finding from per-seed figures of its two variants (paired by seed; see the module
    docstring): {"verdict", "mean", "se", "seeds"}, mean the paired difference in the paper's direction."""
    if len(a) != len(b) or not a:
        raise ValueError(f"a finding needs the same number (>= 1) of seeds on both sides, got {len(a)} and {len(b)}")
    sign = 1.0 if better == "lower" else -1.0
    d = [sign * (y - x) for x, y in zip(a, b)]  # > 0: a is better
    if any(not math.isfinite(v) for v in d):
        return {"verdict": "within noise", "mean": math.nan, "se": math.nan, "seeds": len(d)}
    m, s = _mean_std(d)
    se = s / math.sqrt(len(d)) if len(d) > 1 else math.inf
    if m > NOISE * se:
        verdict = "agrees"
    elif kind == "matches" and m >= -NOISE * se and len(d) > 1:
        verdict = "agrees"
    elif m < -NOISE * se:
        verdict = "disagrees"
    else:
        verdict = "within noise"
    return {"verdict": verdict, "mean": m, "se": se, "seeds": len(d)}


def claim_verdict(verdicts: list[str]) -> str:
    if verdicts and all(v == "agrees" for v in verdicts):
        return "agrees"
    return "disagrees" if "disagrees" in verdicts else "within noise"


def select_claims(only=None, quick: bool = False) -> list[Claim]:
    """The claims to run: `only` (names, also comma-separated), else the quick subset or all of them."""
    if only:
        names = [n for item in only for n in str(item).split(",") if n]
        unknown = [n for n in names if n not in NAMES]
        if unknown:
            raise ELFError(f"unknown claim {', '.join(repr(n) for n in unknown)}; the claims are: {', '.join(NAMES)}")
        return [c for c in CLAIMS if c.name in names]
    return [c for c in CLAIMS if c.name in QUICK] if quick else list(CLAIMS)


# ----------------------------------------------------------------------------------------------------------
# training and measuring
def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Harness:
    """Trains and measures variants under OUT, reusing what is finished (the cache keyed by settings)."""

    def __init__(self, out: Path, base: dict, budget: dict, num: int, cache_dir, device, quiet: bool, printer,
                 judge_settings: dict | None = None):
        self.out, self.base, self.budget, self.num = out, base, budget, num
        self.judge_settings = dict(judge_settings or {})
        self.cache_dir, self.device, self.quiet, self.printer = cache_dir, device, quiet, printer
        self.encoder = None
        self._judge = None

    # the from-scratch T5 space, trained once under OUT/encoder
    def encoder_folder(self) -> Path:
        folder = self.out / "encoder"
        if not (folder / "elflow_encoder.json").is_file():
            self.printer("training the from-scratch T5 encoder (elflow train-encoder's defaults)")
            shutil.rmtree(folder, ignore_errors=True)
            train_encoder(folder, self.base.get("data", "builtin"), cache_dir=self.cache_dir, device=self.device,
                          progress=not self.quiet)
        return folder

    def config(self, variant: Variant, seed: int):
        settings = _merge(self.base, variant.train)
        if "{encoder}" in str(settings.get("space", "")):
            settings["space"] = settings["space"].replace("{encoder}", str(self.encoder_folder()))
        steps = self.budget.get("steps") or BUDGET_CAP
        if self.budget.get("steps") and "warmup" not in settings:  # the quickstart's warm-up share of its 250 steps
            settings["warmup"] = min(RUN_DEFAULTS["quickstart"][0]["warmup"], max(1, steps // 5))
        cfg = TrainConfig.named("quickstart", **{**settings, "seed": seed, "steps": steps, "sample_every": 0,
                                                 "ckpt_every": steps, "keep": 1})
        cfg = cfg.resolved()
        cfg.validate()
        return cfg

    def trained(self, variant: Variant, seed: int) -> Path:
        """The run folder of the variant's training at `seed`, trained now unless finished before."""
        cfg = self.config(variant, seed)
        folder = self.out / "variants" / _key({"train": cfg.to_dict(), "budget": self.budget})
        if (folder / "done.json").is_file():
            return folder
        self.printer(f"  training {variant.name} (seed {seed})")
        minutes = self.budget.get("minutes")
        summary = train(cfg, folder, overwrite=folder.exists(), quiet=self.quiet, cache_dir=self.cache_dir,
                        device=self.device, command="elflow claims",
                        time_limit=minutes * 60 if minutes and not self.budget.get("steps") else None)
        atomic_write_json(folder / "done.json", {"steps": summary["end_step"], "settings": variant.train})
        return folder

    def judge(self):
        if self._judge is None:
            cfg = self.config(Variant("base"), 0)
            tokens = build_space(tokenizer_spec(cfg.resolved().space))
            train_set, val_set = build_dataset(cfg.data, tokens, cfg.length, layout=cfg.layout,
                                               val_fraction=cfg.val_fraction, seed=0, cache_dir=self.cache_dir,
                                               field=cfg.text_field, on_bad=cfg.on_bad)

            folder = cached_judge(row_documents(tokens, train_set), self.cache_dir, self.device,
                                  printer=self.printer, **self.judge_settings)
            self.vocab = corpus_vocabulary(tokens.decode(train_set.tokens[: min(len(train_set), 4000)]))
            self.judge_name = str(folder)
            self._judge = load_judge(folder, device=self.device)
            references = tokens.decode(val_set.tokens[:self.num])  # MAUVE's real text: held-out rows
            self.mauve = mauve_against(references, *self._judge) if len(references) >= MIN_TEXTS else None
        return self._judge

    def measure(self, variant: Variant, seed: int) -> dict:
        """The variant's figures at `seed` (cached beside its run, keyed by the sampler settings)."""
        folder = self.trained(variant, seed)
        judge = self.judge()
        key = _key({"sampling": variant.sampling, "num": self.num, "judge": self.judge_name, "figures": list(FIGURES)})
        path = folder / "measures" / f"{key}.json"
        cached = _read_cache(path, (*FIGURES, "params", "steps"))
        if cached is not None:
            return cached
        net, space = load_for_sampling(folder, device=self.device)
        cfg = self.config(variant, seed)
        held = folder / "heldout.json"
        report = _read_cache(held, ("model_loss", "decode_accuracy"))
        accuracy = (report or {}).get("decode_accuracy")
        if not (isinstance(accuracy, dict) and "p=1.0" in accuracy):
            _, val_set = build_dataset(cfg.data, space, cfg.length, layout=cfg.layout, val_fraction=cfg.val_fraction,
                                       seed=cfg.seed, cache_dir=self.cache_dir, field=cfg.text_field,
                                       on_bad=cfg.on_bad)
            report = validation_report(net, space, val_set, net.record.recipe, rows=64,
                                       decode_levels=(1.0,), device=self.device or "cpu")
            atomic_write_json(held, report)
        method = get_method(net.record.method)
        settings = method.sampling_settings(net.record, seed=seed, batch_size=16, **variant.sampling)
        _, scores = sample_and_score(
            method, net, space, self.num, settings,
            lambda texts: judge_texts(texts, self.vocab, judge, self.mauve),
            folder / "samples" / f"{key}.jsonl", {"variant": variant.name}, cfg.length)
        figures = {"loss": report["model_loss"], "decode_acc": report["decode_accuracy"]["p=1.0"],
                   "gen_ppl": scores.get("gen_ppl", math.nan), "entropy": scores.get("judge_entropy", math.nan),
                   "corpus_words": scores.get("corpus_word_share", math.nan), "mauve": scores.get("mauve", math.nan),
                   "params": net.record.params.model,
                   "steps": read_json(folder / "done.json")["steps"]}
        atomic_write_json(path, figures)
        return figures


def _read_cache(path: Path, keys: tuple) -> dict | None:
    """A figures file this harness wrote (NaN allowed), read by the bounded reader; None when it is missing,
    damaged or lacks one of `keys` (the figures are measured again)."""
    if not path.is_file():
        return None
    try:
        figures = jsonio.read_json(path, max_bytes=jsonio.RECORD_BYTES, own=True, allow_nonfinite=True)
    except ELFError:
        return None
    return figures if all(k in figures for k in keys) else None


def run_claims(claims: list[Claim], out, seeds: int = DEFAULT_SEEDS, minutes: float | None = DEFAULT_MINUTES,
               steps: int | None = None, num: int = 32, base: dict | None = None, cache_dir=None, device=None,
               quiet: bool = True, printer=print, command: str = "elflow claims",
               judge_settings: dict | None = None, progress: bool = True) -> dict:
    """Train, measure and judge every variant of `claims` at seeds 0 .. seeds - 1; writes claims.json,
    claims.md and one plot per claim under `out`; returns the report. `base`: TrainConfig settings over the
    quickstart's for every variant; `judge_settings`: overrides of the cached judge's (compare.JUDGE_DEFAULTS);
    `quiet` hides the trainings' progress bars, `progress` shows one over the variants."""
    out = check_out(out, folder=True)
    with FolderHold(out, "elflow claims"):  # a second report into the same folder is refused while this one runs
        return _run_claims(claims, out, seeds, minutes, steps, num, base, cache_dir, device, quiet, printer, command,
                           judge_settings, progress)


def _run_claims(claims, out, seeds, minutes, steps, num, base, cache_dir, device, quiet, printer, command,
                judge_settings, progress) -> dict:
    from tqdm.auto import tqdm

    budget = {"steps": steps} if steps else {"minutes": minutes}
    harness = Harness(out, dict(base or {}), budget, num, cache_dir, device, quiet, printer, judge_settings)
    results = []
    jobs = [(c, v, s) for c in claims for v in c.variants for s in range(seeds)]
    bar = tqdm(total=len(jobs), disable=not progress, desc="claims", unit="variant")
    for claim in claims:
        printer(f"claim {claim.name}: {claim.title}")
        figures = {}
        for v in claim.variants:
            figures[v.name] = []
            for s in range(seeds):
                figures[v.name].append(harness.measure(v, s))
                bar.update(1)
        findings = []
        for f in claim.findings:
            res = finding_verdict([r[f.figure] for r in figures[f.a]], [r[f.figure] for r in figures[f.b]],
                                  f.better, f.kind)
            findings.append({"finding": f.describe(), "a": f.a, "b": f.b, "figure": f.figure, **res})
        summary = {v: {k: _mean_std([r[k] for r in rows]) for k in (*FIGURES, "params", "steps")}
                   for v, rows in figures.items()}
        results.append({"claim": claim.name, "title": claim.title, "paper": claim.paper,
                        "verdict": claim_verdict([f["verdict"] for f in findings]), "findings": findings,
                        "variants": summary, "seeds": figures})
        _plot(results[-1], out / f"{claim.name}.png")
        printer(f"  -> {results[-1]['verdict']}")
    bar.close()
    report = {"command": command, "budget": budget, "seeds": seeds, "num": num, "noise": NOISE,
              "judge": getattr(harness, "judge_name", None), "claims": results}
    clean = jsonio.json_safe(report)  # nan -> null
    atomic_write_json(out / "claims.json", clean)
    with atomic_write(out / "claims.md", "w") as f:
        f.write(format_markdown(clean))
    printer(format_markdown(clean))
    return clean


def _cell(pair, fmt="{:.3g}") -> str:
    m, s = pair
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "-"
    return fmt.format(m) + ("" if s is None or (isinstance(s, float) and math.isnan(s)) else " ± " + fmt.format(s))


def format_markdown(report: dict) -> str:
    """claims.md: one row per claim, the figures its findings read (mean ± std over seeds) and the verdict."""
    b = report["budget"]
    lines = [f"Command: `{report['command']}`; {report['seeds']} seeds, "
             + (f"{b['steps']} steps" if b.get("steps") else f"{b['minutes']:g} min of training") + " per variant, "
             f"{report['num']} samples per figure; verdict: paired seed differences against {report['noise']:g} "
             "standard errors.", "",
             "| claim | the paper's finding | measured (mean ± std over seeds) | MAUVE | verdict |",
             "|---|---|---|---|---|"]
    for c in report["claims"]:
        shown = []
        for f in c["findings"]:
            for name in (f["a"], f["b"]):
                item = f"{name} {FIGURES[f['figure']]} {_cell(c['variants'][name][f['figure']])}"
                if item not in shown:
                    shown.append(item)
        verdicts = "; ".join(f"{f['finding']}: {f['verdict']}" for f in c["findings"])
        mauve = "; ".join(f"{name} {_cell(v.get('mauve', (None, None)))}" for name, v in c["variants"].items())
        lines.append(f"| {c['title']} | {c['paper']} | {'; '.join(shown)} | {mauve} | **{c['verdict']}** "
                     f"({verdicts}) |")
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: Path) -> None:
    """One panel per figure the claim's findings read: each variant's mean with its seeds' spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = list(dict.fromkeys(f["figure"] for f in result["findings"]))
    fig, axes = plt.subplots(1, len(figs), figsize=(4.5 * len(figs), 3.6), squeeze=False)
    names = list(result["variants"])
    for ax, key in zip(axes[0], figs):
        means = [result["variants"][n][key][0] for n in names]
        stds = [result["variants"][n][key][1] for n in names]
        ax.bar(range(len(names)), means, yerr=[0 if s is None or math.isnan(s) else s for s in stds], capsize=3,
               color="#4c72b0")
        for i, n in enumerate(names):
            ax.scatter([i] * len(result["seeds"][n]), [r[key] for r in result["seeds"][n]], color="k", s=8, zorder=3)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(FIGURES[key], fontsize=10)
    fig.suptitle(f"{result['title']}: {result['verdict']}", fontsize=11)
    fig.tight_layout()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
