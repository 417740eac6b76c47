"""A sampling trajectory (`elflow sample --trajectory`) as one self-contained HTML page: each step's readout,
tokens coloured by when they settled."""

from __future__ import annotations

import html
import json
import math
import stat
from pathlib import Path

from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_text
from elflow.util.jsonio import MAX_JSON_BYTES, BadJSON, parse, read_limited

FORMAT = "elflow-trajectory"


VERSION = 2  # 2: steps counted from 1 (version 1 counted them from 0; read_trajectory reads both)


_WINDOW = 4  # tokens of left context when a token's own piece of text is read off a short decode


def token_spans(tokenizer, ids: list[int], positions: list[int]) -> list[list]:
    """The text `tokenizer` decodes from `ids` (special tokens skipped) as [[piece, [positions]], ...]: the
    pieces join to exactly that text, and each names the `positions` (one per id) whose tokens it shows.

    Each token's piece is what it adds to a decode of the few tokens before it (linear in the length); when
    the pieces do not join to the whole decode (a tokenizer whose decoding is not local), the pieces are cut
    where a decode of the prefix is a prefix of the whole text instead, which is exact for any tokenizer."""
    n = len(ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    if n == 0:
        return []
    windows = []
    for i in range(n):
        a = max(0, i - _WINDOW)
        windows += [ids[a:i], ids[a:i + 1]]
    decoded = tokenizer.batch_decode(windows, skip_special_tokens=True)
    pieces = []
    for left, both in zip(decoded[0::2], decoded[1::2]):
        pieces.append(both[len(left):] if both.startswith(left) else None)
    groups: list[tuple[str, list[int]]]
    if None not in pieces and "".join(pieces) == full:
        groups = [(p, [pos]) for p, pos in zip(pieces, positions)]
    else:
        prefixes = tokenizer.batch_decode([ids[:k] for k in range(1, n + 1)], skip_special_tokens=True)
        groups, start, cut = [], 0, 0
        for k, prefix in enumerate(prefixes, 1):
            if full.startswith(prefix) and (len(prefix) > cut or k == n):
                groups.append((full[cut:len(prefix)], list(positions[start:k])))
                start, cut = k, len(prefix)
    spans = []
    for piece, pos in groups:
        if piece:
            spans.append([piece, pos])
        elif spans:  # a token that shows no text (a special token): it belongs to the piece before it
            spans[-1][1].extend(pos)
    return spans


def trajectory_document(tokenizer, steps: list[dict], samples: list[dict], settings: dict) -> dict:
    """The TRAJECTORY.json object. `steps`: [{"step" (from 1), "t", "ids" (rows of ids), "shown" (per row, the positions
    its text is made of), "known" (per row, the positions held fixed), "texts"}] for the recorded steps in
    order, as `generate.generate` returns them; `samples`: the final records {"index", "text", ("source",
    "reference")} of the same rows."""
    out = []
    for j, rec in enumerate(samples):
        row_steps = []
        for s in steps:
            row, shown = s["ids"][j], s["shown"][j]
            row_steps.append({"ids": row, "text": s["texts"][j],
                              "spans": token_spans(tokenizer, [row[p] for p in shown], shown)})
        out.append({**{k: rec[k] for k in ("index", "text", "source", "reference") if k in rec},
                    "known": steps[0]["known"][j], "steps": row_steps})
    return {"format": FORMAT, "version": VERSION, "settings": settings,
            "steps": [{"step": int(s["step"]), "t": float(s["t"])} for s in steps], "samples": out}


def read_trajectory(path) -> dict:
    """A TRAJECTORY.json, checked, as the current version (a version-1 file's steps, counted from 0, are
    counted from 1): a samples file, another program's JSON, bytes that are not UTF-8 JSON or a newer version
    is one clear error saying what it is and what to do. Only a regular file is read (never a device or a
    fifo). Non-finite numbers (NaN, Infinity) are read as they stand; the page writes them as null."""
    path = Path(path)
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise ELFError(f"{path}: no such file (record a trajectory with `elflow sample RUN --trajectory`)") from None
    except OSError as e:
        raise ELFError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, fifo or socket)"
        raise ELFError(f"{path} is {kind}; pass a trajectory file (OUT.trajectory.json of `elflow sample RUN "
                       "--trajectory`)")
    data = read_limited(path, MAX_JSON_BYTES)  # the bounded reader: a regular file of at most MAX_JSON_BYTES
    try:
        doc = parse(data, str(path), allow_nonfinite=True)
    except BadJSON as e:
        first = data.lstrip().split(b"\n", 1)[0]
        try:
            head = parse(first, str(path), allow_nonfinite=True)
            looks_like_samples = isinstance(head, dict) and "text" in head
        except BadJSON:
            looks_like_samples = False
        if looks_like_samples:
            raise ELFError(f"{path} is a samples file (JSONL), not a trajectory: record one with "
                           f"`elflow sample RUN --trajectory`, which writes OUT.trajectory.json") from None
        detail = str(e)[len(str(path)) + 2:] if str(e).startswith(f"{path}: ") else str(e)
        raise ELFError(f"{path}: not a trajectory ({detail}); record one with `elflow sample RUN "
                       "--trajectory`") from None
    return check_trajectory(doc, path)


def _kind(value) -> str:
    """A JSON value's type, as the document names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


class _Doc:
    """The checks of one document, each failure one line naming the file and the field."""

    def __init__(self, path):
        self.path = path

    def fail(self, field: str, what: str):
        raise ELFError(f"{self.path}: not a trajectory elflow can show: {field} {what} (record one with `elflow "
                       "sample RUN --trajectory`)")

    def need(self, value, field: str, want: str, ok) -> None:
        if not ok(value):
            self.fail(field, f"is {_kind(value)}, not {want}")

    def integer(self, value, field: str, low: int = 0, high: int | None = None, what: str = "a number") -> int:
        """A whole number from `low` to `high` - 1 (`what`: what it counts, for the message)."""
        if isinstance(value, float):
            self.fail(field, f"is {value!r}, not a whole number")
        self.need(value, field, "a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool))
        if value < low or (high is not None and value >= high):
            if high is not None and high <= low:
                self.fail(field, f"is {value}, but the row holds no positions")
            span = f"from {low} to {high - 1}" if high is not None else f">= {low}"
            self.fail(field, f"is {value}, out of range ({what} {span})")
        return value

    def array(self, value, field: str) -> list:
        self.need(value, field, "an array", lambda v: isinstance(v, list))
        return value

    def positions(self, value, field: str, length: int) -> list:
        for i, p in enumerate(self.array(value, field)):
            self.integer(p, f"{field}[{i}]", 0, length, "a position of the row")
        return value


def check_trajectory(doc, path) -> dict:
    """A parsed TRAJECTORY.json, checked field by field as the page reads it, as the current version (a version-1
    file's steps, counted from 0, are counted from 1). Each wrong type or value is one ELFError naming the
    field: the format and version; settings an object; steps [{"step": whole number, increasing, "t": number or
    null}]; each sample an object with "index" (whole number >= 0), "text" (string), "source" / "reference"
    (string or null, if present), "known" (positions of its row) and one step record per step, each with "ids"
    (whole numbers >= 0, as many at every step), "text" (string) and "spans" ([[string, [positions]], ...],
    the strings joining to "text"). Positions lie in the row (0 to len(ids) - 1)."""
    d = _Doc(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ELFError(f"{path} is not an elflow trajectory (no \"format\": \"{FORMAT}\"): record one with "
                       "`elflow sample RUN --trajectory`")
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ELFError(f"{path}: the trajectory's version is {version!r}, not a positive whole number")
    if version > VERSION:
        raise ELFError(f"{path} was written by a newer elflow (trajectory format {version}; this one reads up to "
                       f"{VERSION}): upgrade elflow")
    for key, kind, want in (("settings", dict, "an object"), ("steps", list, "an array"),
                            ("samples", list, "an array")):
        if key not in doc:
            d.fail(f'"{key}"', "is missing")
        d.need(doc[key], f'"{key}"', want, lambda v, kind=kind: isinstance(v, kind))
    n = len(doc["steps"])
    if n == 0 or not doc["samples"]:
        raise ELFError(f"{path}: the trajectory records no steps or no samples")
    first = 0 if version == 1 else 1
    last = first - 1
    for k, s in enumerate(doc["steps"]):
        d.need(s, f"steps[{k}]", "an object", lambda v: isinstance(v, dict))
        step = d.integer(s.get("step"), f"steps[{k}].step", first, what="a step number")
        if step <= last:
            d.fail(f"steps[{k}].step", f"is {step}, not after the step before it ({last})")
        last = step
        d.need(s.get("t"), f"steps[{k}].t", "a number or null", lambda v: v is None or _number(v))
    for i, sample in enumerate(doc["samples"]):
        _check_sample(d, sample, i, n)
    if version == 1:
        doc = {**doc, "version": VERSION, "steps": [{**s, "step": s["step"] + 1} for s in doc["steps"]]}
    return doc


def _check_sample(d: _Doc, sample, i: int, n: int) -> None:
    where = f"samples[{i}]"
    d.need(sample, where, "an object", lambda v: isinstance(v, dict))
    d.integer(sample.get("index"), f"{where}.index", what="a sample index")
    d.need(sample.get("text"), f"{where}.text", "a string", lambda v: isinstance(v, str))
    for key in ("source", "reference"):
        if key in sample:
            d.need(sample[key], f"{where}.{key}", "a string or null", lambda v: v is None or isinstance(v, str))
    steps = d.array(sample.get("steps"), f"{where}.steps")
    if len(steps) != n:
        raise ELFError(f"{d.path}: sample {i} does not hold one record for each of the {n} steps (it holds "
                       f"{len(steps)})")
    length = None
    for k, rec in enumerate(steps):
        at = f"{where}.steps[{k}]"
        d.need(rec, at, "an object", lambda v: isinstance(v, dict))
        ids = d.array(rec.get("ids"), f"{at}.ids")
        for j, token in enumerate(ids):
            d.integer(token, f"{at}.ids[{j}]", what="a token id")
        if length is None:
            length = len(ids)
        elif len(ids) != length:
            d.fail(f"{at}.ids", f"holds {len(ids)} ids where {where}.steps[0] holds {length} (one row, one length)")
        text = rec.get("text")
        d.need(text, f"{at}.text", "a string", lambda v: isinstance(v, str))
        pieces = []
        for j, span in enumerate(d.array(rec.get("spans"), f"{at}.spans")):
            d.need(span, f"{at}.spans[{j}]", "a [piece, [positions]] pair",
                   lambda v: isinstance(v, list) and len(v) == 2)
            d.need(span[0], f"{at}.spans[{j}][0]", "a string (a piece of the text)", lambda v: isinstance(v, str))
            d.positions(span[1], f"{at}.spans[{j}][1]", length)
            pieces.append(span[0])
        if "".join(pieces) != text:
            d.fail(f"{at}.spans", "do not join to its text (the pieces must spell it exactly)")
    if "known" in sample:
        d.positions(sample["known"], f"{where}.known", length)


# ----------------------------------------------------------------------------------------------------------
# the page
_STYLE = """
:root { --fg: #1d2125; --muted: #5f6b76; --line: #d8dee4; --changed: #ffd86b; --known: #dde7f3; --bg: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); margin: 0 auto;
       max-width: 1100px; padding: 24px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 0 0 8px; }
.summary { color: var(--muted); margin: 0 0 16px; }
details { margin: 0 0 16px; }
table.settings { border-collapse: collapse; font-size: 13px; margin-top: 8px; }
table.settings td { border-top: 1px solid var(--line); padding: 2px 14px 2px 0; vertical-align: top; }
table.settings td:first-child { color: var(--muted); }
.controls { display: flex; gap: 12px; align-items: center; background: var(--bg); border: 1px solid var(--line);
            border-radius: 6px; padding: 10px 14px; margin-bottom: 18px; position: sticky; top: 0; z-index: 1; }
.controls input[type=range], .sample input[type=range] { flex: 1; }
button { font: inherit; padding: 2px 12px; }
.legend { font-size: 13px; color: var(--muted); }
.legend span { padding: 0 4px; border-radius: 3px; }
.sample { border: 1px solid var(--line); border-radius: 6px; padding: 14px 16px; margin-bottom: 16px; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; margin-bottom: 10px; }
.pair div { background: var(--bg); border-radius: 4px; padding: 6px 10px; white-space: pre-wrap; }
.label { display: block; font-size: 12px; color: var(--muted); text-transform: uppercase; letter-spacing: .04em; }
.slider-row { display: flex; gap: 12px; align-items: center; }
.step-info { font-variant-numeric: tabular-nums; color: var(--muted); font-size: 13px; min-width: 22em; }
.text { white-space: pre-wrap; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
        font-size: 14px; background: #fff; border: 1px solid var(--line); border-radius: 4px; padding: 8px 10px;
        margin-top: 8px; min-height: 2.5em; }
.tok.changed { background: var(--changed); border-radius: 2px; }
.tok.known { background: var(--known); border-radius: 2px; }
.final { font-size: 13px; color: var(--muted); margin-top: 6px; white-space: pre-wrap; }
"""


_SCRIPT = r"""
(function () {
  const doc = JSON.parse(document.getElementById("trajectory-data").textContent);
  const steps = doc.steps, last = steps.length - 1;
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const fmt = (t) => (typeof t === "number" && isFinite(t) ? t.toFixed(3) : "n/a");  // null: not finite

  const s = doc.settings;
  const desc = [s.sampler && `${s.sampler}`, s.steps && `${s.steps} steps`, s.omega !== undefined && `omega ${s.omega}`,
                s.gamma !== undefined && s.sampler !== "ode" && `gamma ${s.gamma}`,
                s.guidance !== undefined && doc.samples.some((x) => "source" in x) && `guidance ${s.guidance}`,
                s.seed !== undefined && `seed ${s.seed}`].filter(Boolean).join(", ");
  document.getElementById("summary").textContent =
    `${doc.samples.length} sample${doc.samples.length === 1 ? "" : "s"}, ${steps.length} recorded step` +
    `${steps.length === 1 ? "" : "s"}` + (desc ? ` (${desc})` : "") + (s.checkpoint ? ` from ${s.checkpoint}` : "");
  const table = document.getElementById("settings");
  for (const [k, v] of Object.entries(s)) {
    const tr = el("tr");
    tr.append(el("td", "", k), el("td", "", typeof v === "string" ? v : JSON.stringify(v)));
    table.append(tr);
  }

  const views = doc.samples.map((sample, j) => {
    const box = el("section", "sample");
    box.dataset.index = sample.index;
    box.append(el("h2", "", `sample ${sample.index}`));
    if ("source" in sample || "reference" in sample) {
      const pair = el("div", "pair");
      for (const [name, value] of [["source", sample.source], ["reference", sample.reference]]) {
        const d = el("div", name);
        const shown = value === undefined || value === null ? "(none)" : value;
        d.append(el("span", "label", name), document.createTextNode(shown));
        pair.append(d);
      }
      box.append(pair);
    }
    const row = el("div", "slider-row");
    const slider = el("input", "step-slider");
    slider.type = "range"; slider.min = 0; slider.max = last; slider.step = 1; slider.value = last;
    slider.setAttribute("aria-label", `step of sample ${sample.index}`);
    const info = el("span", "step-info");
    row.append(slider, info);
    const text = el("div", "text");
    const final = el("div", "final", `final sample: ${sample.text}`);
    box.append(row, text, final);
    document.getElementById("samples").append(box);
    const known = new Set(sample.known || []);

    function show(k) {
      const rec = sample.steps[k], prev = k > 0 ? sample.steps[k - 1] : null;
      let changedTokens = 0;
      text.replaceChildren();
      for (const [piece, positions] of rec.spans) {
        const lead = piece.trim() ? piece.match(/^\s*/)[0] : "";  // the space before a word is not marked
        if (lead) text.append(document.createTextNode(lead));
        const span = el("span", "tok", piece.slice(lead.length));
        const moved = prev ? positions.filter((p) => !known.has(p) && prev.ids[p] !== rec.ids[p]).length : 0;
        changedTokens += moved;
        if (positions.every((p) => known.has(p))) span.classList.add("known");
        else if (moved) span.classList.add("changed");
        text.append(span);
      }
      slider.value = k;
      info.dataset.step = steps[k].step;
      info.dataset.t = steps[k].t;
      info.textContent = `step ${steps[k].step} of ${s.steps ?? steps.length} \u00b7 t = ${fmt(steps[k].t)}` +
        (prev ? ` \u00b7 ${changedTokens} token${changedTokens === 1 ? "" : "s"} changed` : "");
    }
    slider.addEventListener("input", () => show(Number(slider.value)));
    show(last);
    return show;
  });

  const held = doc.samples.some((x) => x.steps[0].spans.some(([, ps]) => ps.every((p) => (x.known || []).includes(p))));
  document.getElementById("held-key").hidden = !held;  // the key for shaded text only where some is
  const all = document.getElementById("all-steps"), allInfo = document.getElementById("all-info");
  all.max = last; all.value = last;
  const showAll = (k) => {
    all.value = k;
    allInfo.textContent = `step ${steps[k].step} \u00b7 t = ${fmt(steps[k].t)}`;
    views.forEach((show) => show(k));
  };
  all.addEventListener("input", () => showAll(Number(all.value)));
  allInfo.textContent = `step ${steps[last].step} \u00b7 t = ${fmt(steps[last].t)}`;
  const fromHash = () => {  // page.html#step=K shows sampling step K (counted from 1)
    const asked = /step=(\d+)/.exec(location.hash);
    if (!asked) return;
    const k = steps.findIndex((x) => x.step >= Number(asked[1]));
    showAll(k < 0 ? last : k);
  };
  window.addEventListener("hashchange", fromHash);
  fromHash();
  let timer = null;
  const play = document.getElementById("play");
  play.addEventListener("click", () => {
    if (timer) { clearInterval(timer); timer = null; play.textContent = "play"; return; }
    let k = Number(all.value) >= last ? 0 : Number(all.value);
    showAll(k);
    play.textContent = "pause";
    timer = setInterval(() => {
      k += 1;
      if (k > last) { clearInterval(timer); timer = null; play.textContent = "play"; return; }
      showAll(k);
    }, Math.max(60, Math.min(400, 6000 / steps.length)));
  });
})();
"""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(obj):
    """`obj` with every non-finite float (NaN, Infinity) as None: strict JSON, which JSON.parse reads."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _inline_json(obj) -> str:
    """Strict JSON (a non-finite number as null) safe inside a <script> element: no '<', '>' or '&' can end
    it or open a comment."""
    text = json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(doc: dict, title: str | None = None) -> str:
    """The page: one HTML document with the trajectory, its script and its style inline (it loads nothing)."""
    title = title or f"elflow trajectory: {doc['settings'].get('checkpoint', '')}".rstrip(": ")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'">
<title>{html.escape(title)}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p class="summary" id="summary"></p>
<details><summary>settings</summary><table class="settings" id="settings"></table></details>
<div class="controls">
  <button id="play" type="button">play</button>
  <label for="all-steps">all samples</label>
  <input id="all-steps" type="range" min="0" max="0" step="1" value="0">
  <span class="step-info" id="all-info"></span>
  <span class="legend"><span class="tok changed">changed since the previous step</span>
    <span class="tok known" id="held-key">held fixed</span></span>
</div>
<div id="samples"></div>
<script type="application/json" id="trajectory-data">{_inline_json(doc)}</script>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def write_page(doc: dict, path, overwrite: bool = True) -> Path:
    path = Path(path)
    atomic_write_text(path, render_page(doc), overwrite)  # the output rule, at the end (checked at the start)
    return path
