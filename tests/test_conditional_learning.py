"""Conditional ELF learns, end to end from the command line: a tiny network trained with the quickstart's
settings on pairs made of a small vocabulary copies its sources, and reverses them, token for token, well
beyond what the same network does with its source dropped. The sampler's final state holds the data there,
not the sampler's starting noise."""

import json
import random

import pytest
import torch

from elflow.checkpoint import load_for_sampling
from elflow.cli import main
from elflow.encoders import minilm_dir
from elflow.flow import Recipe, generate_tokens
from elflow.generate import conditioning, generate, settings_for

try:
    minilm_dir()
except Exception as e:  # noqa: BLE001
    pytest.skip(f"missing data: the MiniLM tokenizer ({e})", allow_module_level=True)

WORDS = "king lord love night heart sweet good time man day life world old great".split()  # one MiniLM token each
TASKS = {  # name -> (target from the source's words, source lengths in words, training steps)
    "copy": (lambda w: w, (4, 4), 600),
    "reverse": (lambda w: w[::-1], (4, 4), 600),
}


def pairs(task: str, n: int, seed: int) -> list[dict]:
    rule, (lo, hi), _ = TASKS[task]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
        out.append({"input": " ".join(words), "output": " ".join(rule(words))})
    return out


def token_accuracy(space, texts: list[str], refs: list[str]) -> float:
    """Share of the references' tokens read back exactly at their position."""
    right = total = 0
    for text, ref in zip(texts, refs):
        got, want = space.tokenize([text], eos=False)[0], space.tokenize([ref], eos=False)[0]
        right += sum(i < len(got) and got[i] == tok for i, tok in enumerate(want))
        total += len(want)
    return right / total


@pytest.fixture(scope="module", params=list(TASKS))
def trained(request, tmp_path_factory):
    task = request.param
    folder = tmp_path_factory.mktemp(task)
    data, held = folder / "train.jsonl", folder / "held.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs(task, 4000, seed=0)))
    held.write_text("".join(json.dumps(r) + "\n" for r in pairs(task, 64, seed=1)))
    run = folder / "run"
    assert main(["train", "--defaults", "quickstart", "--preset", "tiny", "--space", "random-table:minilm",
                 "--space-dim", "32", "--data", str(data), "--source-length", "8", "--length", "16",
                 "--steps", str(TASKS[task][2]), "--lr", "1e-2", "--warmup", "20", "--sample-every", "0", "--cache-dir",
                 str(folder / "cache"), "--quiet", "--out", str(run)]) == 0
    out = folder / "samples.jsonl"
    assert main(["sample", str(run), "--source", str(held), "--quiet", "--out", str(out)]) == 0
    return task, run, [json.loads(line) for line in out.read_text().splitlines()]


def test_the_model_does_its_task_and_needs_its_source_for_it(trained):
    task, run, records = trained
    loaded, space = load_for_sampling(run)
    refs = [r["reference"] for r in records]
    acc = token_accuracy(space, [r["text"] for r in records], refs)
    settings = settings_for(loaded, seed=0, batch_size=64)
    dropped = generate(loaded.net, space, len(records), settings, sources=[r["source"] for r in records],
                       source_length=loaded.settings["source_length"], progress=False, drop_source=True)
    acc_dropped = token_accuracy(space, [r["text"] for r in dropped], refs)
    assert acc >= 0.9, f"{task}: {acc:.1%} of target tokens right"
    assert acc_dropped <= 0.4 and acc - acc_dropped >= 0.5, f"{task}: {acc:.1%} with the source, {acc_dropped:.1%} without"


def test_the_final_state_holds_the_data_not_the_starting_noise(trained):
    """At the target positions the sampler's final state z differs from the clean target x by nothing that
    correlates with its starting noise z0 (least-squares coefficient of z - x on z0), and no output token is the
    one whose table row lies nearest to the starting noise more often than chance allows."""
    task, run, records = trained
    loaded, space = load_for_sampling(run)
    net, recipe = loaded.net, Recipe.from_dict(loaded.recipe)
    settings = settings_for(loaded, seed=0)
    sources, refs = [r["source"] for r in records], [r["reference"] for r in records]
    L, S = net.config.max_length, loaded.settings["source_length"]
    _, known_mask, known = conditioning(space, L, len(sources), sources, S)
    full = conditioning(space, L, len(sources), [f"{s} {r}" for s, r in zip(sources, refs)], L - 1)
    target = ~known_mask & (full[0] != space.eos_id)  # the reference's target tokens
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        ids, z = generate_tokens(net, len(sources), L, settings.steps, settings.sampler, settings.gamma,
                                 settings.omega, settings.grid, settings.guidance, known, known_mask, g, recipe)
    z0 = recipe.noise_scale * torch.randn(z.shape, generator=torch.Generator().manual_seed(7))
    w = target[..., None].float()
    beta = (((z - full[2]) * z0 * w).sum() / (z0 * z0 * w).sum()).item()
    nearest = (z0 @ net.readout_table.T).argmax(-1)
    hits = ((ids == nearest) & target).float().mean().item()
    assert abs(beta) < 0.05, f"{task}: {beta:.3f} of the starting noise is left in the final state"
    assert hits < 0.05, f"{task}: {hits:.1%} of the target tokens read the starting noise's nearest row"
