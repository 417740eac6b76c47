"""What `elflow view` accepts: a trajectory document checked field by field before the page is written. Every
wrong type or value is refused with one line naming the field; any document the check lets through renders a
page on which every sample and every control is there (a real headless chromium reads it back)."""

import copy
import json
import os
import shutil
import tempfile

import pytest
from helpers import assert_one_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elflow.cli import main
from elflow.experiments.viewer import FORMAT, check_trajectory, render_page
from elflow.util.errors import ELFError

WORDS = ["the", " king", " of", " night", "!", " love", " sweet"]


def document(texts=(("the", " king", "!"), ("love", " of", " the")), steps: int = 3, known=((0,), ())) -> dict:
    """A trajectory as `elflow sample --trajectory` writes it, built by hand: one token per piece, the row one
    position longer than the pieces (a pad at the end), the last step's text the sample's."""
    samples = []
    for j, pieces in enumerate(texts):
        length = len(pieces) + 1
        rows = []
        for k in range(steps):
            ids = [10 * (k + 1) + p for p in range(length)]
            for p in known[j]:
                ids[p] = 5
            shown = pieces[:max(1, len(pieces) - (steps - 1 - k))]
            rows.append({"ids": ids, "text": "".join(shown), "spans": [[piece, [p]] for p, piece in enumerate(shown)]})
        samples.append({"index": j, "text": rows[-1]["text"], "known": list(known[j]), "steps": rows})
    return {"format": FORMAT, "version": 2, "settings": {"steps": steps, "sampler": "sde", "checkpoint": "runs/x"},
            "steps": [{"step": k + 1, "t": k / steps} for k in range(steps)], "samples": samples}


def view(tmp_path, capsys, doc) -> tuple[int, str, object]:
    """`elflow view` of `doc` written to a file: (exit code, stderr, the page's path)."""
    src, page = tmp_path / "t.trajectory.json", tmp_path / "t.html"
    for p in (src, page):
        if p.exists():
            p.unlink()
    src.write_text(json.dumps(doc))
    code = main(["view", str(src), "--out", str(page)])
    return code, capsys.readouterr().err, page


def test_a_document_as_sample_writes_it_is_shown(tmp_path, capsys):
    code, err, page = view(tmp_path, capsys, document())
    assert code == 0 and page.is_file() and "2 samples x 3 steps" in err


def _set(path, value):
    def edit(doc):
        *head, last = path
        target = doc
        for key in head:
            target = target[key]
        target[last] = value
        return doc
    return edit


# (name, edit of a good document, the field the line names, what it says)
BAD = [
    ("span-piece-a-number", _set(("samples", 0, "steps", 0, "spans", 0, 0), 123),
     "samples[0].steps[0].spans[0][0]", "is a number, not a string"),
    ("known-a-number", _set(("samples", 0, "known"), 5), "samples[0].known", "is a number, not an array"),
    ("span-positions-a-number", _set(("samples", 1, "steps", 2, "spans", 1, 1), 7),
     "samples[1].steps[2].spans[1][1]", "is a number, not an array"),
    ("span-position-past-the-row", _set(("samples", 1, "steps", 2, "spans", 1, 1), [4]),
     "samples[1].steps[2].spans[1][1][0]", "is 4, out of range (a position of the row from 0 to 3)"),
    ("known-position-negative", _set(("samples", 0, "known"), [-1]), "samples[0].known[0]", "is -1, out of range"),
    ("id-a-string", _set(("samples", 0, "steps", 1, "ids", 2), "7"), "samples[0].steps[1].ids[2]",
     "is a string, not a whole number"),
    ("id-a-fraction", _set(("samples", 0, "steps", 1, "ids", 2), 2.5), "samples[0].steps[1].ids[2]",
     "is 2.5, not a whole number"),
    ("row-changes-length", _set(("samples", 0, "steps", 1, "ids"), [1, 2]), "samples[0].steps[1].ids",
     "holds 2 ids where samples[0].steps[0] holds 4"),
    ("step-text-a-number", _set(("samples", 1, "steps", 0, "text"), 3), "samples[1].steps[0].text", "is a number"),
    ("pieces-do-not-join", _set(("samples", 1, "steps", 0, "text"), "other"), "samples[1].steps[0].spans",
     "do not join to its text"),
    ("span-not-a-pair", _set(("samples", 0, "steps", 0, "spans", 0), ["the"]), "samples[0].steps[0].spans[0]",
     "not a [piece, [positions]] pair"),
    ("sample-text-null", _set(("samples", 0, "text"), None), "samples[0].text", "is null, not a string"),
    ("source-a-list", _set(("samples", 0, "source"), ["a"]), "samples[0].source", "is an array, not a string"),
    ("index-negative", _set(("samples", 1, "index"), -3), "samples[1].index", "is -3, out of range"),
    ("index-true", _set(("samples", 1, "index"), True), "samples[1].index", "is true/false, not a whole number"),
    ("steps-not-increasing", _set(("steps", 2, "step"), 2), "steps[2].step", "not after the step before it (2)"),
    ("step-zero-in-version-2", _set(("steps", 0, "step"), 0), "steps[0].step", "is 0, out of range"),
    ("t-a-string", _set(("steps", 1, "t"), "0.5"), "steps[1].t", "is a string, not a number or null"),
    ("settings-an-array", _set(("settings",), [1]), '"settings"', "is an array, not an object"),
    ("sample-an-array", _set(("samples", 1), []), "samples[1]", "is an array, not an object"),
]


@pytest.mark.parametrize("edit, field, says", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_wrong_field_is_one_line_naming_it_and_no_page(tmp_path, capsys, edit, field, says):
    code, err, page = view(tmp_path, capsys, edit(document()))
    line = assert_one_error(code, err, "view", field, says)
    assert "record one with `elflow sample RUN --trajectory`" in line or "steps or no samples" in line
    assert not page.exists()


# ----------------------------------------------------------------------------------------------------------
# any document: refused with one line, or a page


def _paths(value, prefix=()):
    """Every path into a JSON value: its own and each of its members', recursively."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 12) | st.integers(-10**30, 10**30)
    | st.floats(allow_nan=True, allow_infinity=False) | st.sampled_from(WORDS) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["step", "t", "ids", "x"]), inner,
                                                                max_size=3),
    max_leaves=6)


@st.composite
def documents(draw):
    """A good document with a few of its fields replaced or removed."""
    texts = draw(st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4), min_size=1, max_size=3))
    steps = draw(st.integers(1, 3))
    known = [draw(st.lists(st.integers(0, len(t)), max_size=2, unique=True)) for t in texts]
    doc = document(texts, steps, known)
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(list(_paths(doc))[1:]))
        *head, last = path
        target = doc
        for key in head:
            target = target[key]
        if isinstance(target, dict) and draw(st.booleans()):
            del target[last]
        else:
            target[last] = draw(json_values)
        if path[:1] == ("format",) or path[:1] == ("version",):
            break
    return doc


def _one_line_or_doc(doc):
    """check_trajectory's verdict: (None, the checked document) or (the one-line message, None)."""
    try:
        return None, check_trajectory(copy.deepcopy(doc), "t.json")
    except ELFError as e:
        return str(e), None


@settings(max_examples=300, deadline=None)
@given(documents())
def test_any_document_is_refused_in_one_line_or_has_the_fields_the_page_reads(doc):
    message, checked = _one_line_or_doc(doc)
    if message is not None:
        assert message.startswith("t.json") and len(message.splitlines()) == 1
        return
    # what the page's script reads, checked here independently of the checker's own code
    n = len(checked["steps"])
    for sample in checked["samples"]:
        row = len(sample["steps"][0]["ids"])
        assert isinstance(sample.get("known", []), list)
        assert all(isinstance(p, int) and 0 <= p < row for p in sample.get("known", []))
        assert len(sample["steps"]) == n
        for rec in sample["steps"]:
            assert len(rec["ids"]) == row
            assert all(isinstance(piece, str) and isinstance(ps, list) and all(0 <= p < row for p in ps)
                       for piece, ps in rec["spans"])
            assert "".join(piece for piece, _ in rec["spans"]) == rec["text"]
    assert all(isinstance(s["step"], int) and (s.get("t") is None or isinstance(s["t"], (int, float)))
               for s in checked["steps"])
    assert "<script" in render_page(checked)


@pytest.fixture(scope="module")
def browser():
    from test_viewer import _browser_or_skip

    os.environ.setdefault("SE_OFFLINE", "true")
    driver, profile = _browser_or_skip()
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


PAGE_STATE = """
const sections = [...document.querySelectorAll("section.sample")];
return {sections: sections.length,
        sliders: sections.map((s) => Number(s.querySelector("input.step-slider").max)),
        infos: sections.map((s) => s.querySelector(".step-info").textContent.length > 0),
        all: Number(document.getElementById("all-steps").max),
        allInfo: document.getElementById("all-info").textContent.length > 0,
        summary: document.getElementById("summary").textContent.length > 0};
"""


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_every_document_let_through_shows_every_sample_and_control(browser, doc):
    message, checked = _one_line_or_doc(doc)
    if message is not None:
        return
    folder = tempfile.mkdtemp(prefix="elflow-view-")
    try:
        page = os.path.join(folder, "p.html")
        with open(page, "w", encoding="utf-8") as f:
            f.write(render_page(checked))
        browser.get_log("browser")  # what earlier pages logged
        browser.get("file://" + page)
        state = browser.execute_script(PAGE_STATE)
        n = len(checked["steps"])
        assert state == {"sections": len(checked["samples"]), "sliders": [n - 1] * len(checked["samples"]),
                         "infos": [True] * len(checked["samples"]), "all": n - 1, "allInfo": True, "summary": True}
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        shutil.rmtree(folder, ignore_errors=True)
