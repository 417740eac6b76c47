"""The GPT-2 tokenizer built from the whisper ranks (against known GPT-2 ids and against tiktoken on the same
ranks) and the offline judge: elflow causal blocks == the Hugging Face Qwen3 model it is saved as."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from helpers import MISSING_DATA

from elflow.eval.judge import CausalJudge, JudgeConfig, save_judge, to_hf
from elflow.util.errors import ELFError


@pytest.fixture(scope="module")
def ranks_path():
    from elflow.eval.gpt2_tokenizer import fetch_gpt2_ranks

    try:
        return fetch_gpt2_ranks()
    except ELFError as e:
        pytest.skip(f"{MISSING_DATA}: GPT-2 ranks unavailable: {e}")


@pytest.fixture(scope="module")
def gpt2_tok(ranks_path):
    from elflow.eval.gpt2_tokenizer import build_gpt2_tokenizer

    return build_gpt2_tokenizer()


# ----------------------------------------------------------------------------------------------------------
# tokenizer


KNOWN = {  # GPT-2 ids as published (encoder.json)
    "Hello world": [15496, 995],
    " the": [262],
    "<|endoftext|>": [50256],
    "!": [0],
    '"': [1],
    "\n": [198],
    ",": [11],
    ".": [13],
    " and": [290],
    " of": [286],
    " to": [284],
    "The": [464],
}


def test_known_gpt2_ids(gpt2_tok):
    for text, ids in KNOWN.items():
        assert gpt2_tok(text, add_special_tokens=False)["input_ids"] == ids, text
    assert gpt2_tok.eos_token_id == gpt2_tok.pad_token_id == 50256 and len(gpt2_tok) == 50257
    assert gpt2_tok.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


def test_matches_tiktoken_on_same_ranks(gpt2_tok, ranks_path):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    enc = tiktoken.Encoding("gpt2-local", pat_str=r50k_pat_str, mergeable_ranks=load_tiktoken_bpe(str(ranks_path)),
                            special_tokens={"<|endoftext|>": 50256})
    texts = [
        "Hello world", "  leading spaces and\ttabs\n\nnewlines  ", "It's we'll they've I'm she'd you're",
        "naïve café Ünïcödé — “quotes” 日本語のテキスト 😀🎉", "1234567890 3.14159 -42 1e10",
        "To be, or not to be: that is the question.\r\nWhether 'tis nobler in the mind to suffer",
        "supercalifragilisticexpialidocious antidisestablishmentarianism", "x<|endoftext|>y", "    ",
        "def f(x):\n    return x ** 2  # comment",
    ]
    for t in texts:
        assert gpt2_tok(t, add_special_tokens=False)["input_ids"] == enc.encode(t, allowed_special="all"), t
        assert gpt2_tok.decode(enc.encode(t, allowed_special="all")) == t


def test_merges_recovered_exactly(ranks_path):
    from elflow.eval.gpt2_tokenizer import load_ranks, merges_from_ranks

    ranks = load_ranks(ranks_path)
    merges = merges_from_ranks(ranks)
    assert len(ranks) == 50256 and len(merges) == 50000  # GPT-2: 256 bytes + 50,000 merges
    # every merge produces the token of the next rank, in order
    assert all(ranks[a + b] == 256 + i for i, (a, b) in enumerate(merges))


def test_tokenizer_from_tiny_ranks():
    from elflow.eval.gpt2_tokenizer import tokenizer_from_ranks

    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"ab"] = 256
    ranks[b"abc"] = 257
    tok = tokenizer_from_ranks(ranks)
    assert tok.eos_token_id == 258
    assert tok("abcab", add_special_tokens=False)["input_ids"] == [257, 256]
    assert tok("cab", add_special_tokens=False)["input_ids"] == [99, 256]


# ----------------------------------------------------------------------------------------------------------
# the judge network and its Hugging Face form


TINY = JudgeConfig(vocab_size=300, hidden=48, depth=2, heads=3, context=32, eos_id=299)


def tiny_judge(seed=0):
    torch.manual_seed(seed)
    judge = CausalJudge(TINY)
    with torch.no_grad():  # move every trainable weight away from its init so no term is trivially zero
        for p in judge.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    return judge.eval()


def test_judge_is_causal():
    judge = tiny_judge()
    x = torch.randint(0, 299, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 299, (2, 8))
    with torch.no_grad():
        a, b = judge(x), judge(y)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-3)


def test_hf_qwen3_logits_equal_elflow_logits():
    judge = tiny_judge()
    hf = to_hf(judge)
    x = torch.randint(0, 300, (3, 32))
    with torch.no_grad():
        ours, theirs = judge(x), hf(input_ids=x).logits
    assert ours.abs().max() > 1.0
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


def test_saved_folder_loads_without_remote_code(tmp_path):
    from transformers import AutoModelForCausalLM

    from elflow.eval.gpt2_tokenizer import tokenizer_from_ranks
    from elflow.eval.judge import load_judge
    from elflow.eval.metrics import generative_perplexity

    judge = tiny_judge(1)
    # a byte-level tokenizer of 298 ranks + EOS (id 298), within the judge's 300-token vocabulary
    ranks = {bytes([i]): i for i in range(256)}
    for j in range(42):
        ranks[b"a" + bytes([ord("A") + j])] = 256 + j
    tok = tokenizer_from_ranks(ranks, model_max_length=TINY.context)
    assert tok.eos_token_id == 298
    save_judge(judge, tok, tmp_path, {"heldout_perplexity": 1.0})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=False)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    x = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert torch.allclose(judge(x), hf(input_ids=x).logits, atol=1e-5, rtol=0)
    info = json.loads((tmp_path / "elflow_judge.json").read_text())
    assert "NOT GPT-2 Large" in info["note"] and info["config"]["hidden"] == TINY.hidden
    model, tok2 = load_judge(tmp_path, device="cpu")
    res = generative_perplexity(["aAaB abc", "hello"], model, tok2)
    assert res["max_length"] == TINY.context and res["num_samples"] == 2 and res["gen_ppl"] > 1


def test_a_judge_saved_on_a_full_disk_leaves_its_folder_as_it_was(tmp_path):
    from helpers import fill, small_tmpfs

    from elflow.eval.gpt2_tokenizer import tokenizer_from_ranks
    from elflow.util.files import NoSpace

    tok = tokenizer_from_ranks({bytes([i]): i for i in range(256)}, model_max_length=TINY.context)
    with small_tmpfs(tmp_path / "fs", "2m") as fs:
        out = fs / "judge"
        filler = fill(fs, 64 * 1024)  # room for a few small files, not for the weights
        with pytest.raises(NoSpace, match=f"no space left on device while writing the judge into {out}"):
            save_judge(tiny_judge(), tok, out, {})
        assert list(out.iterdir()) == []  # no 0-byte config.json: a rerun is not refused as "not empty"
        filler.unlink()
        save_judge(tiny_judge(), tok, out, {})
        assert (out / "config.json").stat().st_size > 0 and (out / "model.safetensors").exists()


def test_train_judge_says_what_it_does_before_training(tmp_path, gpt2_tok, capsys, monkeypatch):
    """The tokenizer, the corpus's tokenization and the split are named on stderr as each starts, before the
    network is built and the progress bar appears."""
    import elflow.eval.judge as judge_module
    from elflow.cli import main

    class Stop(Exception):
        pass

    def built(cfg):
        raise Stop()

    monkeypatch.setattr(judge_module, "CausalJudge", built)
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    with pytest.raises(Stop):
        main(["train-judge", "--data", str(text), "--out", str(tmp_path / "judge"), "--steps", "3",
              "--context", "16"])
    said = capsys.readouterr().err.splitlines()
    assert said[0].startswith("train-judge: building the GPT-2 tokenizer")
    assert any(line.startswith(f"train-judge: reading and tokenizing {text}") for line in said)
    assert said[-1].startswith("train-judge: ") and "training tokens" in said[-1] and "training 3 steps" in said[-1]


def test_train_judge_smoke(tmp_path, gpt2_tok, capsys):
    """`elflow train-judge` end to end on a small text: trains, saves, and the folder works as --judge."""
    from elflow.cli import main

    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "judge"
    rc = main(["train-judge", "--data", str(text), "--out", str(out), "--steps", "3", "--batch-size", "2",
               "--hidden", "16", "--depth", "1", "--heads", "2", "--context", "16"])
    assert rc == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["steps"] == 3 and 1 < info["heldout_perplexity"] < 60000
    samples = tmp_path / "s.jsonl"
    samples.write_text(json.dumps({"text": "The quick brown fox"}) + "\n" + json.dumps({"text": ""}) + "\n")
    assert main(["eval", str(samples), "--judge", str(out), "--json", "--device", "cpu"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["num_samples"] == 1 and res["num_empty"] == 1 and res["gen_ppl"] > 1 and res["max_length"] == 16


# ----------------------------------------------------------------------------------------------------------
# the size check of `elflow train-judge`
BIG = str(10**12)


@pytest.mark.parametrize("flag,value,needle", [
    *[(f, v, f"{f} must be at least 1") for f in ("--steps", "--batch-size", "--hidden", "--depth", "--heads")
      for v in ("0", "-4")],
    ("--context", "0", "--context must be at least 2"), ("--context", "-4", "--context must be at least 2"),
    ("--steps", BIG, "--steps must be an integer from 1 to 100,000,000"),
    ("--hidden", "1000000", "training the judge at --batch-size 8 --context 128 --hidden 1000000"),  # 10^13 weights
    ("--batch-size", "1000000", "training the judge at --batch-size 1000000 --context 128"),  # 10^6 x 128 x 50,257
    *[(f, BIG, "needs about") for f in ("--batch-size", "--depth", "--context", "--hidden")],
    ("--heads", BIG, "must split into 1000000000000 heads"),
])
def test_train_judge_refuses_a_bad_size_in_one_line_before_any_work(tmp_path, capsys, monkeypatch, flag, value,
                                                                    needle):
    """train-judge --hidden 10^6, --batch-size 10^6 and the rest: one line, exit 2, before the tokenizer is built
    and with nothing written (--out is not made)."""
    from helpers import assert_one_error

    import elflow.eval.judge as j
    from elflow.cli import main
    from elflow.util import budget

    monkeypatch.setattr(budget, "available_memory", lambda device=None: (8 * 2**30, "available on this machine"))
    monkeypatch.setattr(j, "build_gpt2_tokenizer", None)  # building the tokenizer would fail
    out = tmp_path / "judge"
    code = main(["train-judge", flag, value, "--out", str(out)])
    assert_one_error(code, capsys.readouterr().err, "train-judge", needle)
    assert not out.exists()
