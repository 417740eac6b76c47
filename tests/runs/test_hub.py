"""`elflow push`: the dry-run folder is exactly what would be uploaded; it loads through `elflow.load` (as a
folder and, from the Hub's local cache, as a hub id) and samples the texts of the run it came from; its model
card names the run's settings; without a token or network, one line."""

import json
from pathlib import Path

import pytest
import torch
from helpers import checkpoint_weights, tiny_config

import elflow
from elflow.cli import main
from elflow.train import train

FILES = {"README.md", "config.json", "model.safetensors"}


@pytest.fixture(scope="module")
def pushed(tmp_path_factory, tiny_t5_dir, tiny_corpus_file):
    root = tmp_path_factory.mktemp("push")
    train(tiny_config(tiny_t5_dir, tiny_corpus_file), root / "run", cache_dir=root / "cache", quiet=True)
    assert main(["push", str(root / "run"), "someone/tiny-elf", "--dry-run", "--out", str(root / "folder"),
                 "--device", "cpu", "--quiet"]) == 0
    return root / "run", root / "folder"


@pytest.mark.slow
def test_a_space_on_a_local_encoder_folder_is_named_in_a_warning(pushed, tiny_t5_dir, capsys):
    from elflow.lifecycle.push import local_encoders

    spec = json.loads((pushed[1] / "config.json").read_text())["record"]["space"]
    assert local_encoders(spec) == [str(tiny_t5_dir)]
    assert local_encoders({"kind": "hf", "name": "minilm"}) == []


def _texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_the_folder_loads_and_samples_the_texts_of_its_run(pushed, tmp_path):
    run, folder = pushed
    assert {p.name for p in folder.iterdir()} == FILES
    _, ema = checkpoint_weights(run, 6)
    net = elflow.load(folder)
    assert net.state_dict().keys() == ema.keys()
    assert all(torch.equal(net.state_dict()[k], ema[k]) for k in ema)
    for where in (run, folder):  # the model's own sampling defaults, seed 0, as the card's samples
        assert main(["sample", str(where), "--num", "3", "--seed", "0", "--device", "cpu", "--quiet",
                     "--out", str(tmp_path / f"{where.name}.jsonl")]) == 0
    texts = _texts(tmp_path / f"{run.name}.jsonl")
    assert _texts(tmp_path / f"{folder.name}.jsonl") == texts
    card = (folder / "README.md").read_text()
    shown = [line[3:-1] for line in card.splitlines() if line.startswith("- `")]
    assert shown == [t.replace("\n", " ").replace("`", "'") for t in texts]


def test_the_card_names_the_runs_settings(pushed):
    run, folder = pushed
    card = (folder / "README.md").read_text()
    meta = json.loads((run / "run.json").read_text())["record"]
    assert card.startswith("---\n") and "library_name: elflow" in card
    rows = dict(line.strip("|").split(" | ", 1) for line in card.splitlines() if line.startswith("| ") and " | " in line)
    rows = {k.strip(): v.strip(" |") for k, v in rows.items()}
    assert rows["parameters"] == f"{meta['params']['model']:,}"
    assert rows["preset"] == "tiny" and rows["steps trained"] == "6 of 6" and rows["sequence length"] == "16"
    assert rows["training tokens"] == f"{6 * 4 * 16:,}" and rows["precision"] == "fp32" and rows["EMA decay"] == "0.9"
    settings = json.loads((run / "run.json").read_text())["train"]
    assert rows["data"] == settings["data"] and rows["embedding space"] == meta["space"]["id"]
    assert json.loads((folder / "config.json").read_text())["train"] == settings  # the folder keeps them
    assert rows["sampling defaults"].startswith("steps 32, sampler sde")
    assert rows["training loss, total (step 6)"] == f"{_last_loss(run):.4g}"
    assert 'elflow.load("someone/tiny-elf")' in card and "elflow sample someone/tiny-elf" in card


def test_the_cards_install_line_and_imports_work(pushed):
    """No elflow package is on PyPI: the card installs it from its source (the repository recorded in the
    package's metadata, else a checkout), links no package index, and its Python imports run."""
    from elflow.lifecycle.push import install_lines, source_url

    card = (pushed[1] / "README.md").read_text()
    assert "pypi.org" not in card and not any(line.startswith("pip install elflow") for line in card.splitlines())
    assert all(line in card.splitlines() for line in install_lines(source_url()))
    assert install_lines(None)[-1].startswith('pip install -e ".[offline]"') and "not on PyPI" in install_lines(None)[0]
    assert install_lines("https://example.org/elflow.git")[0].startswith(
        'pip install "elflow[offline] @ git+https://example.org/elflow.git"')
    python = card.split("```python\n", 1)[1].split("```", 1)[0]
    exec("\n".join(line for line in python.splitlines() if line.startswith(("import ", "from "))), {})


def _last_loss(run: Path) -> float:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "train"][-1]["loss"]


def test_a_hub_id_loads_what_push_wrote_from_the_hubs_cache(pushed, tmp_path, monkeypatch):
    """The files of the folder in the Hub's cache layout (as a download leaves them), read offline by id."""
    import huggingface_hub.constants

    run, folder = pushed
    repo = tmp_path / "hub" / "models--someone--tiny-elf"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    for f in folder.iterdir():
        (repo / "snapshots" / commit / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    net = elflow.load("someone/tiny-elf")
    _, ema = checkpoint_weights(run, 6)
    assert all(torch.equal(net.state_dict()[k], ema[k]) for k in ema)


def test_push_refuses_bad_input_in_one_line(pushed, tmp_path, monkeypatch, capsys):
    run, folder = pushed
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for args, says in ((["push", str(run), "someone/tiny-elf"], "cannot upload to the Hugging Face Hub: "),
                       (["push", str(run), "no-owner", "--dry-run", "--out", str(tmp_path / "a")], "owner/name"),
                       (["push", str(run), "someone/x", "--dry-run"], "--out DIR"),
                       (["push", str(run), "someone/x", "--dry-run", "--out", str(folder)], "is not empty"),
                       (["push", str(tmp_path), "someone/x", "--dry-run", "--out", str(tmp_path / "b")], "")):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("elflow push: error: ") and says in err[0], err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # a weight file changed after the push is refused by the loader
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (bad / "model.safetensors").write_bytes(bytes(data))
    assert main(["sample", str(bad), "--num", "1", "--quiet", "--out", str(tmp_path / "s.jsonl")]) == 2
    assert "sha256" in capsys.readouterr().err


def test_the_folder_teaches_a_distillation_logged_to_wandb(pushed, tmp_path, monkeypatch):
    """Every command that takes a model takes the folder: one short distillation round from it, logged to W&B
    (offline) under the round's name when wandb is installed."""
    import importlib.util

    _, folder = pushed
    wandb = importlib.util.find_spec("wandb") is not None
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "pd"
    assert main(["distill", str(folder), "--student-steps", "2", "--teacher-steps", "4", "--steps-per-round", "2",
                 "--ckpt-every", "2", "--out", str(out), "--quiet",
                 *(["--wandb", "elflow-test"] if wandb else [])]) == 0
    assert (out / "2-step" / "checkpoints" / "step_0000002").is_dir()
    if wandb:
        from helpers import wandb_offline_runs

        (logged,) = wandb_offline_runs(out / "2-step")
        assert logged["config"]["wandb_run"] == "pd/2-step" and logged["config"]["distillation"]["student_steps"] == 2
        recs = [json.loads(line) for line in (out / "2-step" / "metrics.jsonl").read_text().splitlines()]
        recs = [r for r in recs if r["kind"] == "train"]
        assert recs and [h["_step"] for h in logged["history"]] == [r["step"] for r in recs]
        assert logged["history"][-1]["loss"] == pytest.approx(recs[-1]["loss"])


def test_a_dry_run_folder_appears_whole_or_not_at_all(pushed, tmp_path, monkeypatch):
    """The model folder is built under a temporary name and renamed into place with its card: while it is
    built nothing stands at --out (a kill there leaves no folder that loads as a whole model without its
    card), and a failure leaves nothing at all."""
    from elflow.lifecycle import push as push_module

    run, _ = pushed
    out = tmp_path / "folder"
    seen = []
    card = push_module.model_card

    def model_card(*a, **k):
        seen.append(out.exists())  # the weights and config.json are written by now
        return card(*a, **k)

    monkeypatch.setattr(push_module, "model_card", model_card)
    push_module.push(str(run), "someone/x", out=out, dry_run=True, num_samples=0, device="cpu", progress=False)
    assert seen == [False] and {p.name for p in out.iterdir()} == FILES
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]  # no temporary left beside it

    def broken(*a, **k):
        raise RuntimeError("stopped while writing the card")

    monkeypatch.setattr(push_module, "model_card", broken)
    with pytest.raises(RuntimeError):
        push_module.push(str(run), "someone/x", out=tmp_path / "other", dry_run=True, num_samples=0, device="cpu",
                         progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]
