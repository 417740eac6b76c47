"""The AR and MDLM baselines against hand computations: losses, float64 draws, samplers, sizes, training."""

import json
import math
import types

import pytest
import torch

from elflow import methods
from elflow.methods import ar, mdlm
from elflow.methods.baseline import draw_categorical
from elflow.methods.token_net import TokenLMConfig, fit_token_lm, token_lm_params
from elflow.model import ELF, get_config, num_params
from elflow.util.errors import ELFError

V = 40
SPACE = types.SimpleNamespace(vocab_size=V)
CFG = TokenLMConfig(depth=2, hidden=32, heads=2, vocab_size=V, max_length=12)


def built(module, seed=0, **kw):
    torch.manual_seed(seed)
    return module.build(CFG.replace(**kw), SPACE).eval()


def fixed_batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4] = mask[1, 0] = False
    return tokens, mask


# ----------------------------------------------------------------------------------------------------------
# the AR model


def test_ar_loss_equals_a_hand_written_causal_nll():
    model = built(ar)
    tokens, mask = fixed_batch()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(tokens.shape[0]):
            for j in range(tokens.shape[1]):
                if not mask[b, j]:
                    continue
                prefix = torch.tensor([[V] + tokens[b, :j].tolist()])  # BOS, then the ids before x_j
                logits = model(prefix)[0, -1].double()  # the prefix alone: no later id can leak in
                total += float(-torch.log_softmax(logits, -1)[tokens[b, j]])
                count += 1
    loss, metrics = ar.loss(model, tokens, mask)
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    assert float(metrics["tokens"]) == count and float(metrics["nll_sum"]) == pytest.approx(total, rel=1e-5)


def test_ar_key_value_cache_gives_the_full_forward():
    model = built(ar)
    ids = torch.randint(0, V + 1, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ar.cached_logits(model, ids), model(ids), atol=1e-5)


def recording(monkeypatch, module):
    """Wrap the module's categorical draw; returns the list of weight tensors it was given."""
    seen = []

    def wrapped(weights, generator=None):
        seen.append(weights.clone())
        return draw_categorical(weights, generator)

    monkeypatch.setattr(module, "draw_categorical", wrapped)
    return seen


def test_ar_sampler_draws_each_id_from_the_model_in_float64(monkeypatch):
    model = built(ar)
    seen = recording(monkeypatch, ar)
    ids = ar.generate_tokens(model, 4, 10, ar.ARSampling(), torch.Generator().manual_seed(0))
    assert ids.shape == (4, 10) and len(seen) == 10
    assert all(w.dtype == torch.float64 for w in seen)
    with torch.no_grad():  # the distribution each id was drawn from, by a full forward over the sampled rows
        expected = torch.softmax(model(ar.shifted_inputs(model, ids)).double(), -1)  # (4, 10, V)
    for pos, w in enumerate(seen):
        assert torch.allclose(w, expected[:, pos], atol=1e-6)
        assert (w.gather(1, ids[:, pos:pos + 1]) > 0).all()


def test_top_p_keeps_the_smallest_set_with_that_mass():
    probs = torch.tensor([[0.1, 0.5, 0.05, 0.2, 0.15]], dtype=torch.float64)
    assert ar.top_p_filter(probs, 0.6).tolist() == [[0.0, 0.5, 0.0, 0.2, 0.0]]  # 0.5 < 0.6, then 0.5 + 0.2
    assert ar.top_p_filter(probs, 0.75).tolist() == [[0.0, 0.5, 0.0, 0.2, 0.15]]
    assert ar.top_p_filter(probs, 0.01).tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0]]  # the top id always stays
    assert torch.equal(ar.top_p_filter(probs, 1.0), probs)
    w = ar.next_token_probs(torch.log(probs.float()), ar.ARSampling(temperature=0.5))  # p^2, renormalised
    assert torch.allclose(w, probs ** 2 / (probs ** 2).sum(), atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# MDLM


def test_mdlm_nelbo_follows_its_formula_on_a_hand_checked_example():
    model = built(mdlm)
    tokens, mask = fixed_batch()
    t = torch.tensor([0.25, 0.5])
    masked = torch.tensor([[1, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.bool)  # mask[0, 4], mask[1, 0]
    # make the mask id's logit dominate every position: SUBS must still never give it mass
    read_out = model.head
    model.head = lambda h: read_out(h) + 100 * (torch.arange(V + 1) == V)
    with torch.no_grad():
        x_t = torch.where(masked, torch.full_like(tokens, V), tokens)
        logits = model(x_t).double()
    assert (logits.argmax(-1) == V).all()
    total = 0.0
    for b in range(2):
        for j in range(6):
            if masked[b, j] and mask[b, j]:
                total += float(-torch.log_softmax(logits[b, j, :V], -1)[tokens[b, j]]) / float(t[b])
    loss, metrics = mdlm.nelbo(model, tokens, t, masked, mask)
    assert loss.item() == pytest.approx(total / int(mask.sum()), rel=1e-5)
    assert float(metrics["masked"]) == int((masked & mask).sum()) == 5
    none, _ = mdlm.nelbo(model, tokens, t, torch.zeros_like(masked), mask)  # nothing masked: nothing to pay
    assert none.item() == 0.0


def test_mdlm_times_and_masking_follow_the_schedule():
    g = torch.Generator().manual_seed(0)
    t = mdlm.draw_times(8, g, eps=1e-3).sort().values
    assert ((t >= 1e-3) & (t < 1)).all()
    assert torch.allclose(t.diff(), torch.full((7,), (1 - 1e-3) / 8), atol=1e-6)  # one per 1/8 of [eps, 1)
    plain = mdlm.draw_times(4000, g, eps=0.2, low_discrepancy=False)
    assert plain.min() >= 0.2 and abs(float(plain.mean()) - 0.6) < 0.02
    rows = torch.tensor([0.1, 0.3, 0.6, 0.9])
    masked = mdlm.draw_masking(torch.zeros(4, 20000, dtype=torch.long), rows, g)
    assert torch.allclose(masked.float().mean(1), rows, atol=0.01)


def test_mdlm_sampler_unmasks_on_schedule_and_never_emits_the_mask(monkeypatch):
    model = built(mdlm, max_length=64)
    inputs = []
    model.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].clone()))
    seen = recording(monkeypatch, mdlm)
    ids = mdlm.generate_tokens(model, 64, 64, mdlm.MDLMSampling(steps=4), torch.Generator().manual_seed(0))
    assert not (ids == V).any() and ids.max() < V
    assert all(w.dtype == torch.float64 and (w[..., V] == 0).all() for w in seen)
    # the network sees x_t at t = 1, 3/4, 1/2, 1/4: each position still masked with probability t
    fractions = [float((x == V).float().mean()) for x in inputs]
    assert fractions[0] == 1.0 and len(fractions) == 4
    assert fractions[1:] == pytest.approx([0.75, 0.5, 0.25], abs=0.03)
    for before, after in zip(inputs, inputs[1:] + [ids]):  # unmasked ids are kept
        kept = before != V
        assert torch.equal(after[kept], before[kept])


@pytest.mark.parametrize("module,settings", [(ar, ar.ARSampling(temperature=0.9, top_p=0.95)),
                                             (mdlm, mdlm.MDLMSampling(steps=5))])
def test_samplers_are_reproducible_per_seed_and_differ_across_seeds(module, settings):
    model = built(module)

    def draw(seed):
        return module.generate_tokens(model, 3, 12, settings, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))


def test_categorical_draws_resolve_float64_differences():
    g = torch.Generator().manual_seed(5)
    u = torch.rand(16, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(5))  # the draws to come
    # id 1 holds a sliver of mass 2e-12 just where each row's draw falls: float32 cannot resolve it
    weights = torch.cat([u - 1e-12, torch.full_like(u, 2e-12), 1 - u - 1e-12], dim=1)
    assert (draw_categorical(weights, g) == 1).all()
    freq = torch.bincount(draw_categorical(torch.tensor([0.2, 0.0, 0.5, 0.3]).expand(200000, 4), g), minlength=4)
    assert freq[1] == 0 and torch.allclose(freq.double() / 200000, torch.tensor([0.2, 0.0, 0.5, 0.3],
                                                                                dtype=torch.float64), atol=0.005)


# ----------------------------------------------------------------------------------------------------------
# sizes, the method registry, training


def test_num_params_counts_every_table_and_block():
    H, d, M = 32, 16, int(int(4 * 32) * 2 / 3)
    block = H + (3 * H * H + 3 * H) + 2 * d + (H * H + H) + H + (2 * H * M + 2 * M) + (M * H + H)
    assert num_params(built(ar)) == (V + 1) * H + 2 * block + H + H * V  # BOS row in; V out
    assert num_params(built(mdlm)) == (V + 1) * H + 2 * block + H + H * (V + 1)  # mask row in and out
    assert num_params(built(mdlm, tie_embeddings=True)) == (V + 1) * H + 2 * block + H
    for module, (i, o) in ((ar, (V + 1, V)), (mdlm, (V + 1, V + 1))):
        for kw in ({}, {"tie_embeddings": True}, {"depth": 3, "hidden": 48, "heads": 3}):
            assert token_lm_params(CFG.replace(**kw), i, o) == num_params(built(module, **kw))


@pytest.mark.parametrize("module", [ar, mdlm])
@pytest.mark.parametrize("tie", [False, True])
def test_fit_config_matches_an_elf_parameter_count(module, tie):
    with torch.device("meta"):
        target = ELF(get_config("demo")).num_params()  # the demo's ELF: about 15 M parameters
    space = types.SimpleNamespace(vocab_size=30522)
    base = TokenLMConfig(depth=4, hidden=256, heads=4, max_length=64, tie_embeddings=tie)
    cfg = module.fit_config(target, space, base)
    with torch.device("meta"):
        model = module.build(cfg, space)
    assert abs(num_params(model) - target) / target <= 0.03
    assert cfg.head_dim == 64 and cfg.vocab_size == 30522
    with pytest.raises(ValueError, match="within"):
        fit_token_lm(1000, 30523, 30522, base)  # the tables alone are larger
    with torch.device("meta"):
        trunk_target = ELF(get_config("demo")).num_params(exclude_decode_head=True)
    cfg = module.fit_config(trunk_target, space, base, tables=False)
    with torch.device("meta"):
        model = module.build(cfg, space)
    trunk = num_params(model) - sum(num_params(m) for m in (model.embed, model.lm_head) if m is not None)
    assert abs(trunk - trunk_target) / trunk_target <= 0.03


def test_unknown_method_is_a_one_line_error_listing_the_choices():
    with pytest.raises(ELFError) as e:
        methods.get_method("gpt")
    assert "\n" not in str(e.value) and all(name in str(e.value) for name in ("elf", "ar", "mdlm"))
    assert methods.get_method("ar") is ar.METHOD and methods.get_method("mdlm") is mdlm.METHOD
    assert methods.get_method("elf").name == "elf" and methods.METHOD_NAMES == ("elf", "ar", "mdlm")


@torch.no_grad()
def heldout_loss(method, model, dataset, batch: int = 32, rows: int = 256, seed: int = 0) -> float:
    """The method's loss terms summed over the scored positions of the first `rows` rows, per scored position
    (the draws, MDLM's times and masks, from `seed`, so two models see the same ones)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    total = count = 0.0
    n = min(rows, len(dataset))
    for i in range(0, n, batch):
        b = dataset.batch(torch.arange(i, min(i + batch, n)))
        _, metrics = method.objective(model, b["tokens"], b, method.token_draw(b["tokens"], g), None)
        total += float(metrics["nll_sum"])
        count += float(metrics["tokens"])
    return total / max(count, 1.0)


@pytest.mark.parametrize("name", ["ar", "mdlm"])
def test_a_few_steps_of_the_trainer_lower_the_heldout_loss(name, tmp_path, tiny_t5_dir, tiny_corpus_file):
    """15 steps of the one trainer (elflow.train.train) on the tiny corpus's token ids: the held-out loss of the
    trained weights falls well below that of an untrained network of the same shape, which is near uniform."""
    from elflow.config import TrainConfig
    from elflow.data.datasets import build_dataset
    from elflow.runs.load import load
    from elflow.space import build_space
    from elflow.train import train

    cache = tmp_path / "cache"
    cfg = TrainConfig(method=name, preset="tiny", data=str(tiny_corpus_file), space=f"t5:{tiny_t5_dir}", length=16,
                      batch=16, steps=15, warmup=1, lr=1e-2, ema_decay=0.9, val_fraction=0.1, log_every=1,
                      ckpt_every=15, dtype="fp32", seed=0)
    summary = train(cfg, tmp_path / "run", cache_dir=cache, quiet=True)
    recs = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert summary["end_step"] == 15 and len(recs) == 15
    method = methods.get_method(name)
    space = build_space(method.space_spec({"kind": "t5", "name": str(tiny_t5_dir)}))
    _, val = build_dataset(str(tiny_corpus_file), space, 16, val_fraction=0.1, seed=0, cache_dir=cache)
    trained = load(tmp_path / "run", use_ema=False)
    torch.manual_seed(1)
    before = heldout_loss(method, method.network(trained.config, space), val)
    assert before == pytest.approx(math.log(space.vocab_size), abs=0.4)  # an untrained model is near uniform
    assert heldout_loss(method, trained, val) < before - 0.15


# ----------------------------------------------------------------------------------------------------------
# the three methods in one harness


def test_distinct_ngrams_by_hand():
    from elflow.experiments.compare import distinct_ngrams

    texts = ["the cat the cat", "a cat"]  # bigrams: (the cat) (cat the) (the cat) | (a cat)
    assert distinct_ngrams(texts, 1) == pytest.approx(3 / 6)
    assert distinct_ngrams(texts, 2) == pytest.approx(3 / 4)
    assert distinct_ngrams(["one"], 2) == 0.0


@pytest.mark.slow
def test_compare_trains_three_matched_methods_and_judges_them(tmp_path, tiny_t5_dir, tiny_corpus_file):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from elflow.config import TrainConfig
    from elflow.experiments.compare import compare

    tok = AutoTokenizer.from_pretrained(tiny_t5_dir)
    tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    judge = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=320, n_positions=64,
                                       bos_token_id=1, eos_token_id=1)).eval()
    cfg = TrainConfig(preset="tiny", data=str(tiny_corpus_file), space=f"t5:{tiny_t5_dir}", length=16, batch=4,
                      warmup=1, ema_decay=0.9, log_every=1, ckpt_every=3, dtype="fp32", seed=1, sampling={"sampler": "vc"},
                      match="trunk")
    lines = []
    res = compare(cfg, tmp_path, steps=3, num=4, judge=(judge, tok), elf_steps=(4,), omegas=(1.0,),
                  ar_temperatures=(0.8, 1.0), mdlm_steps=(4,), cache_dir=tmp_path / "cache", device="cpu",
                  printer=lines.append)
    info = res["methods"]
    for name in ("elf", "ar", "mdlm"):  # every method: the same budget, through the one trainer
        assert info[name]["steps"] == 3 and info[name]["tokens"] == 3 * 4 * 16
        assert json.loads((tmp_path / name / "run.json").read_text())["record"]["method"] == name
    with torch.device("meta"):
        from elflow.runs.load import read_record

        elf_trunk = ELF(read_record(tmp_path / "elf").network).num_params(exclude_decode_head=True)
    for name in ("ar", "mdlm"):
        model = {"ar": ar, "mdlm": mdlm}[name].build(TokenLMConfig(**json.loads(
            (tmp_path / name / "run.json").read_text())["record"]["network"]), types.SimpleNamespace(vocab_size=300))
        assert abs(methods.trunk_params(model) - elf_trunk) / elf_trunk <= 0.05
    assert [(r["method"], r["setting"]) for r in res["rows"]] == [
        ("elf", "steps=4 omega=1"), ("ar", "temperature=0.8"), ("ar", "temperature=1"), ("mdlm", "steps=4"),
        ("held-out text", "")]
    for r in res["rows"]:  # ELF after 3 steps may emit (nearly) empty texts, which a judge cannot score
        assert set(r) >= {"gen_ppl", "judge_entropy", "word_entropy", "corpus_word_share", "distinct_2"}
        assert r["method"] == "elf" or (r["gen_ppl"] > 1 and r["judged"] == 4)
        assert 0 <= r["distinct_2"] <= 1 and 0 <= r["corpus_word_share"] <= 1
    assert (tmp_path / "compare.png").exists() and (tmp_path / "compare.json").exists()
    assert len((tmp_path / "samples" / "ar_temperature0.8.jsonl").read_text().splitlines()) == 4
    assert any("judge ppl" in line for line in lines)


# ----------------------------------------------------------------------------------------------------------
# the samplers' size checks
@pytest.mark.parametrize("steps", [10**12, 10_001])
def test_an_mdlm_step_count_past_the_bound_is_refused_before_its_time_grid(steps):
    """MDLM --steps 10^12 made a 8 TB time grid: now one line before anything is drawn."""
    with pytest.raises(ELFError, match=r"^the MDLM sampler's steps must be an integer from 1 to 10,000 .*--steps$"):
        mdlm.generate_tokens(built(mdlm), 2, 12, mdlm.MDLMSampling(steps=steps), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("module,settings", [(ar, ar.ARSampling()), (mdlm, mdlm.MDLMSampling(steps=4))])
def test_a_sampling_batch_over_the_memory_is_refused_naming_its_flags(monkeypatch, module, settings):
    from elflow.util import budget

    monkeypatch.setattr(budget, "available_memory", lambda device=None: (2**30, "available on this machine"))
    with pytest.raises(ELFError) as e:
        module.generate_tokens(built(module), 10**8, 12, settings, torch.Generator().manual_seed(0))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{module.METHOD.name.upper()} sampling at --batch 100000000 --length "
                                                "12") and "more than the 1.0 GiB of memory" in line
    assert module.generate_tokens(built(module), 4, 12, settings, torch.Generator().manual_seed(0)).shape == (4, 12)


@pytest.mark.slow
def test_sample_refuses_an_mdlm_step_count_past_the_bound_in_one_line_writing_nothing(tmp_path, capsys,
                                                                                        tiny_t5_dir, tiny_corpus_file):
    from helpers import assert_one_error

    from elflow.cli import main

    run = tmp_path / "mdlm"
    assert main(["train", "--method", "mdlm", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space",
                 f"t5:{tiny_t5_dir}", "--length", "16", "--batch", "4", "--steps", "1", "--warmup", "0", "--dtype",
                 "fp32", "--quiet", "--cache-dir", str(tmp_path / "cache"), "--out", str(run)]) == 0
    capsys.readouterr()
    out = tmp_path / "s.jsonl"
    code = main(["sample", str(run), "--num", "2", "--steps", str(10**12), "--quiet", "--out", str(out)])
    assert_one_error(code, capsys.readouterr().err, "sample", "--steps must be an integer from 1 to 10,000",
                     "got 1,000,000,000,000")
    assert not out.exists()
