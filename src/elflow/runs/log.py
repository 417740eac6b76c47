"""What a run writes besides its checkpoints: metrics.jsonl (trimmed to the resumed step), TensorBoard, the
progress bar and samples on the terminal, and loss.png."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from elflow.flow import TIME_BINS, time_bin_labels
from elflow.runs.folder import LOSS_PLOT, METRICS_FILE, REPORT_FILE, TENSORBOARD
from elflow.util import jsonio
from elflow.util.devices import device_name, fast_bf16
from elflow.util.errors import ELFError
from elflow.util.files import append_own, atomic_write, atomic_write_text, own_folder

# metrics.jsonl is read whole, as a regular file of the run's own: a record a step at --log-every 1 is ~500 bytes,
# so ELF-B's 95,000 steps take ~50 MB
METRICS_BYTES = 512 * 2**20


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line that is not a JSON object (the half-written last line of a
    killed run) is passed over."""
    recs = []
    if not os.path.lexists(path):
        return recs
    for line in jsonio.read_limited(path, METRICS_BYTES, own=True).decode("utf-8", errors="replace").splitlines():
        try:
            rec = jsonio.parse(line, str(path), allow_nonfinite=True)
        except ELFError:
            continue
        if isinstance(rec, dict):
            recs.append(rec)
    return recs


def trim_metrics(out: Path, step: int) -> int:
    """On resume from the checkpoint at `step`: metrics.jsonl keeps its records up to that step (a killed
    run logged past its last checkpoint; those steps are trained again) and loses a half-written last line.
    Returns how many lines went."""
    path = out / METRICS_FILE
    if not os.path.lexists(path):
        return 0
    raw = jsonio.read_limited(path, METRICS_BYTES, own=True).decode("utf-8", errors="replace")
    kept, dropped = [], 0
    for line in raw.splitlines():
        try:
            rec = jsonio.parse(line, str(path), allow_nonfinite=True)
        except ELFError:
            rec = None
        steps = rec.get("step") if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or (isinstance(steps, (int, float)) and steps > step):
            dropped += bool(line.strip())
            continue
        kept.append(line)
    if dropped or (raw and not raw.endswith("\n")):
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped


class RunLogger:
    """Rank 0's output: a progress bar, metrics.jsonl, optional TensorBoard and Weights & Biases (the same
    records), the samples shown during training, the loss-curve PNG.

    `tracker` is the run's W&B run (elflow.tracking.Tracker, started with the run's settings as its config):
    it gets every metrics record at its step and the samples as a table, and is finished by `close`."""

    def __init__(self, out: Path, total: int, start: int, enabled: bool, tensorboard: bool, show: bool = True,
                 tracker=None):
        self.out, self.enabled, self.show = out, enabled, show
        self.bar = None
        self.tb = None
        self.tracker = tracker if enabled else None
        if enabled and show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(str(own_folder(out / TENSORBOARD, "the run's TensorBoard files")))
                except ImportError:
                    print("warning: TensorBoard is not installed (pip install tensorboard); logging to JSONL only",
                          file=sys.stderr)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        append_own(self.out / METRICS_FILE, json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])
        if self.tracker is not None:
            self.tracker.log(rec, step=rec.get("step"))

    @property
    def wants_samples(self) -> bool:
        """Whether samples made during training go anywhere (the terminal or W&B)."""
        return self.enabled and (self.show or self.tracker is not None)

    def samples(self, step: int, texts: list[str]) -> None:
        """The samples of the EMA model at `step`: printed, and added to W&B's samples table."""
        for i, text in enumerate(texts):
            self.write(f"[step {step}] sample {i}: {text[:300]}")
        if self.tracker is not None:
            self.tracker.samples(texts, step)

    def advance(self, n: int, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix(postfix, refresh=False)

    def write(self, msg: str) -> None:
        if self.enabled and self.show:
            (self.bar.write if self.bar is not None else print)(msg)

    def close(self, ok: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.tracker is not None:
            self.tracker.finish(ok)


LOSS_NAMES = {"loss": "total", "loss_denoise": "denoising (v-space MSE)", "loss_decode": "decoding (cross-entropy)",
              "loss_per_token": "next-token / masked-token cross-entropy"}


# a legend below the axes, off the curves
LEGEND_BELOW = dict(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)


# the values a log axis is labelled with, per decade, from the sparsest set to the densest
NICE_MANTISSAS = ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9))


def nice_ticks(lo: float, hi: float, least: int = 3) -> list[float]:
    """At least `least` round values in [lo, hi] (0 < lo < hi) for a log axis: 1, 2, 5, 10, ..., or the
    denser sets of NICE_MANTISSAS where the range is narrow; evenly spaced round values (1.1, 1.2, ...) where
    even the densest set has too few."""
    from matplotlib import ticker

    decades = range(math.floor(math.log10(lo)), math.floor(math.log10(hi)) + 1)
    for mantissas in NICE_MANTISSAS:
        ticks = [float(f"{m * 10.0 ** e:.6g}") for e in decades for m in mantissas]
        ticks = [t for t in ticks if lo <= t <= hi]
        if len(ticks) >= least:
            return ticks
    even = ticker.MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
    return [float(f"{t:.6g}") for t in even if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)] or [float(f"{lo:.3g}")]


def _value_axis(ax, values: list[float]) -> None:
    """A log axis with a handful of labelled ticks across the data's own range (a narrow range such as 1.1-1.6
    gets ticks inside it); a linear axis where some value is not positive (a log axis would drop it)."""
    from matplotlib import ticker

    values = [v for v in values if math.isfinite(v)]
    if not values or min(values) <= 0:
        ax.set_yscale("linear")
        return
    ax.set_yscale("log")
    lo, hi = min(values), max(values)
    ticks = [float(f"{lo:.3g}")] if hi / lo < 1.02 else nice_ticks(lo, hi)  # a flat curve: one tick at its value
    ax.yaxis.set_major_locator(ticker.FixedLocator(ticks))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(ticker.NullLocator())


def training_records(run_dir: Path) -> list[dict]:
    """The training records of RUN/metrics.jsonl (kind "train"), in order; a line cut short by a killed run is
    skipped."""
    return [r for r in read_metrics(Path(run_dir) / METRICS_FILE) if r.get("kind", "train") == "train"
            and isinstance(r.get("step"), (int, float))]


def plot_losses(run_dir: Path) -> None:
    """RUN/loss.png (loss_figure), written atomically; nothing without training records."""
    fig = loss_figure(run_dir)
    if fig is None:
        return
    import matplotlib.pyplot as plt

    with atomic_write(run_dir / LOSS_PLOT) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def loss_figure(run_dir: Path):
    """The training losses (total, denoising, decoding) and the denoising loss per time bin of RUN/metrics.jsonl;
    where the run folder holds a held-out report (RUN/report.json of `elflow quickstart`), the per-dimension
    Gaussian baseline's held-out denoising loss beside them, dashed (overall on the left, per bin on the
    right). None without training records."""
    recs = training_records(run_dir)
    if not recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        val = jsonio.read_json(run_dir / REPORT_FILE, max_bytes=jsonio.RECORD_BYTES, own=True,
                               allow_nonfinite=True).get("validation") or {}
    except (ELFError, AttributeError):
        val = {}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 5.2))
    shown = []
    for key, name in LOSS_NAMES.items():
        pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
        if pts:
            line, = a.plot(*zip(*pts), label=name, lw=1.2, marker="o" if len(pts) < 12 else None, ms=3)
            shown += [y for _, y in pts]
            if key == "loss_denoise" and isinstance(val.get("baseline_loss"), (int, float)):
                a.axhline(val["baseline_loss"], ls="--", lw=1.2, color=line.get_color(),
                          label="denoising: Gaussian baseline (held-out)")
                shown.append(val["baseline_loss"])
    _value_axis(a, shown)
    a.set_xlabel("optimiser step")
    a.set_ylabel("training loss")
    a.set_title("training loss")
    a.legend(**LEGEND_BELOW)
    baseline = {v["t"]: v["baseline"] for v in val.get("bins", []) if isinstance(v.get("baseline"), (int, float))}
    shown = []
    for i, label in enumerate(time_bin_labels()):
        pts = [(r["step"], r[f"loss_{label}"]) for r in recs if isinstance(r.get(f"loss_{label}"), (int, float))]
        if pts:
            line, = b.plot(*zip(*pts), label=f"t in [{TIME_BINS[i]}, {TIME_BINS[i + 1]})", lw=1.2,
                           marker="o" if len(pts) < 12 else None, ms=3)
            shown += [y for _, y in pts]
            if label in baseline:
                b.axhline(baseline[label], ls="--", lw=1.2, color=line.get_color())
                shown.append(baseline[label])
    if b.lines:  # ELF's denoising loss per time bin (a token-level baseline has none)
        if baseline:
            b.plot([], [], ls="--", color="0.4", label="Gaussian baseline (held-out), same colour")
        _value_axis(b, shown)
        b.legend(**LEGEND_BELOW)
    else:
        b.text(0.5, 0.5, "no denoising loss: this method has no time bins", ha="center", va="center",
               transform=b.transAxes, fontsize=9, color="0.4")
        b.set_yticks([])
    b.set_xlabel("optimiser step")
    b.set_ylabel("denoising loss (v-space MSE)")
    b.set_title("denoising loss per time bin")
    fig.tight_layout()
    return fig


def tracked_settings(setup) -> dict:
    """What a W&B run records as its config: the run's settings and how this process runs them."""
    return {**setup.cfg.to_dict(), "method": setup.method.name, "params": setup.params, "world_size": setup.world,
            "device": str(setup.device), "micro_batch": setup.micro, "accumulation": setup.accum,
            "schedule_steps": setup.steps, "warmup_steps": setup.warmup}


def describe_start(setup) -> str:
    """One line on what runs where: the method and its size, the device and the precision (and why)."""
    why = ""
    if setup.device.type == "cpu":
        why = (" (this CPU has native bf16 matmuls; --dtype fp32 for full precision)" if setup.dtype == "bf16"
               else " (this CPU has no native bf16 matmuls)" if not fast_bf16(setup.device) else "")
    ranks = f" x {setup.world} ranks" if setup.world > 1 else ""
    return (f"training {setup.method.title} ({setup.params['model']:,} parameters) on "
            f"{device_name(setup.device)}{ranks}, "
            f"precision {setup.dtype}{why}")
