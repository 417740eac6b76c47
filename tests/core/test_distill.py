"""Progressive distillation: the teacher's side against the authors' vectors, the student's loss, the rounds."""

import json
from pathlib import Path

import pytest
import torch
from helpers import built_from, cli, reference_dir
from safetensors.torch import load_file

import elflow
from elflow import distill
from elflow.flow import distilled_defaults
from elflow.methods import pd
from elflow.runs.checkpoint import write_state
from elflow.util.errors import ELFError

REF = reference_dir("authors_cond_distill.safetensors", "official_tiny.safetensors")

TOL = 1e-5


@pytest.fixture(scope="module")
def official_net():
    from elflow.runs.released import released_to_elflow

    ref = load_file(REF / "official_tiny.safetensors")
    sd = released_to_elflow({k[len("params."):]: v for k, v in ref.items() if k.startswith("params.")})
    return built_from(sd).eval()


@pytest.fixture(scope="module")
def case():
    ref = load_file(REF / "authors_cond_distill.safetensors")
    return {k[len("distill."):]: v for k, v in ref.items() if k.startswith("distill.")}


def close(a, b):
    return (a - b).abs().max().item()


def _slot(case, init):
    known = case["cond_seq_mask"].bool()
    use = case["use_self_cond"].bool()[:, None, None]
    slot = torch.where(use, init, torch.zeros_like(init))
    return torch.where(known[..., None], case["x0"], slot)


def test_reference_case_has_rows_with_and_without_a_source(case):
    n_known = case["cond_seq_mask"].sum(-1)
    assert (n_known == 0).any() and (n_known > 0).any()
    assert case["use_self_cond"].bool().any() and (~case["use_self_cond"].bool()).any()


@torch.no_grad()
def test_teacher_init_and_slot_match_the_authors(official_net, case):
    known = case["cond_seq_mask"].bool()
    init = pd.teacher_init(official_net, case["z_t_s"], case["t_s"], case["omega"], case["x0"], known)
    assert close(init, case["teacher_init"]) < TOL
    assert close(_slot(case, init), case["sc_half"]) < TOL


@torch.no_grad()
@pytest.mark.parametrize("kind", ["sub_steps", "uniform", "one_step"])
def test_pd_target_matches_the_authors(official_net, case, kind):
    known = case["cond_seq_mask"].bool()
    K = case["sub_step_times"].shape[1] - 1
    steps, times = {"sub_steps": (K, case["sub_step_times"]), "uniform": (K, None), "one_step": (1, None)}[kind]
    target = pd.pd_target(official_net, case["z_t_s"], case["t_s"], case["t_t"], case["omega"],
                               case["sc_half"], case["x0"], known, steps, sub_step_times=times, t_eps=0.05)
    assert close(target, case[f"target_{kind}"]) < TOL


# ----------------------------------------------------------------------------------------------------------
# the student's side


def test_sub_step_times_run_from_t_s_to_t_t_in_order():
    g = torch.Generator().manual_seed(0)
    t_s = torch.tensor([0.0, 0.3, 0.75])
    t_t = t_s + 0.25
    times = pd.draw_sub_step_times(t_s, t_t, 8, g)
    assert times.shape == (3, 9)
    assert torch.equal(times[:, 0], t_s) and torch.equal(times[:, -1], t_t)
    assert (times.diff(dim=1) >= 0).all()
    # the interior points are t_s + s u with u logit-normal: mapped back they are sorted sigmoid(N(-1.5, 0.8))
    u = (times[:, 1:-1] - t_s[:, None]) / 0.25
    g2 = torch.Generator().manual_seed(0)
    expect = torch.sigmoid(-1.5 + 0.8 * torch.randn(3 * 7, generator=g2)).reshape(3, 7).sort(dim=1).values
    assert torch.allclose(u, expect, atol=1e-5)


@torch.no_grad()
def test_pd_target_of_an_exact_straight_line_teacher_is_its_guess():
    """A teacher that always answers the same x makes every Euler step head for that x: the K-step
    endpoint read back as a one-step prediction is that x, for any sub-step times."""
    x_star = torch.randn(2, 5, 3)

    def teacher(z, t, omega, x_prev):
        return x_star

    t_s, t_t = torch.tensor([0.1, 0.5]), torch.tensor([0.35, 0.75])
    z = torch.randn(2, 5, 3)
    known = torch.zeros(2, 5, dtype=torch.bool)
    times = pd.draw_sub_step_times(t_s, t_t, 4, torch.Generator().manual_seed(1))
    tgt = pd.pd_target(teacher, z, t_s, t_t, torch.ones(2), torch.zeros_like(z), z, known, 4, times)
    assert torch.allclose(tgt, x_star, atol=1e-5)
    # an interval below 1e-3 returns the teacher's last guess
    tgt = pd.pd_target(teacher, z, t_s, t_s + 1e-4, torch.ones(2), torch.zeros_like(z), z, known, 4)
    assert torch.equal(tgt, x_star)


def _tiny_pair(seed=0):
    from elflow.model import ELF, get_config

    torch.manual_seed(seed)
    teacher = ELF(get_config("tiny", max_length=8))
    for p in teacher.parameters():  # a teacher whose x head is not zero
        p.data.add_(0.05 * torch.randn_like(p))
    teacher.eval().requires_grad_(False)
    student = ELF(teacher.config)
    student.load_state_dict(teacher.state_dict())
    return teacher, student


def test_one_optimiser_step_lowers_the_distillation_error_on_a_fixed_batch():
    from elflow.flow import Recipe

    teacher, student = _tiny_pair()
    B, L, C = 6, 8, teacher.config.dim
    recipe = Recipe(decode_prob=0.0)
    g = torch.Generator().manual_seed(3)
    draw = pd.draw_distill_noise((B, L, C), recipe, 0.25, 4, g, torch.Generator().manual_seed(4))
    x = torch.randn(B, L, C, generator=g)
    tokens = torch.randint(0, teacher.config.vocab_size, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, -2:] = False

    source = (torch.arange(L) < 2)[None].expand(B, L)

    def loss():
        return pd.distill_loss(student, teacher, x, tokens, draw, recipe, mask, known=source, teacher_steps=4)

    before, rows = loss()
    assert rows["denoise"].gt(0).all() and not rows["decode"].any()
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    before.backward()
    opt.step()
    with torch.no_grad():
        after, _ = loss()
    assert after.item() < before.item() * 0.999
    # the loss is the token mean of the squared error to pd_target over the batch's scored positions
    with torch.no_grad():
        known = (torch.arange(L) < 2)[None].expand(B, L)
        kn = known[..., None]
        t = draw.t[:, None, None]
        z = torch.where(kn, x, t * x + (1 - t) * 2.0 * draw.eps)
        slot = torch.where(kn, x, torch.zeros_like(x))
        init = pd.teacher_init(teacher, z, draw.t, draw.omega, x, known)
        slot = torch.where(draw.self_cond[:, None, None] & ~kn, init, slot)
        tgt = pd.pd_target(teacher, z, draw.t, draw.t_next, draw.omega, slot, x, known, 4, draw.sub_times)
        err = (student(z, draw.t, draw.omega, slot) - tgt).pow(2).mean(-1)
        w = (mask & ~known).float()
        expect = (err * w).sum() / w.sum()
    assert after.item() == pytest.approx(expect.item(), rel=1e-5)


@pytest.mark.parametrize("clean", [0.0, 0.5])
def test_decode_rows_score_the_cross_entropy(clean):
    from elflow.flow import Recipe

    teacher, student = _tiny_pair(1)
    B, L, C = 4, 8, teacher.config.dim
    recipe = Recipe(decode_prob=1.0, decode_clean_prob=clean)
    g = torch.Generator().manual_seed(5)
    draw = pd.draw_distill_noise((B, L, C), recipe, 0.5, 2, g, torch.Generator().manual_seed(6))
    assert draw.decode.all() and not draw.self_cond.any() and (draw.t == 1).all()
    assert (draw.p == 1).any() == (clean > 0)  # the teacher's recipe decides the clean share
    x = torch.randn(B, L, C, generator=g)
    tokens = torch.randint(0, teacher.config.vocab_size, (B, L), generator=g)
    with torch.no_grad():
        loss, rows = pd.distill_loss(student, teacher, x, tokens, draw, recipe, teacher_steps=2)
        z = draw.p * x + (1 - draw.p) * recipe.decode_noise_scale * draw.eps
        logits = student.decode(z, draw.omega)
        expect = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5)
    assert rows["decode"].gt(0).all() and not rows["denoise"].any()


def test_schedule_checks():
    assert pd.check_schedule([16, 8, 4, 2, 1], 64) == [16, 8, 4, 2, 1]
    with pytest.raises(ELFError, match="decrease strictly"):
        pd.check_schedule([4, 4, 2], 8)
    with pytest.raises(ELFError, match="decrease strictly"):
        pd.check_schedule([2, 4], 8)
    with pytest.raises(ELFError, match="do not divide"):
        pd.check_schedule([16, 8, 3], 64)
    assert distilled_defaults(4) == {"steps": 4, "sampler": "sde", "gamma": 1.5, "omega": 2.5}
    assert distilled_defaults(16)["gamma"] == 2.0 and distilled_defaults(16)["omega"] == 2.0


# ----------------------------------------------------------------------------------------------------------
# the rounds, end to end on a tiny teacher


def _files(run: Path, step: int):
    ck = run / "checkpoints" / f"step_{step:07d}"
    return load_file(ck / "model.safetensors"), load_file(ck / "ema.safetensors")


# the module's teacher (conftest.teacher_run): two steps, both at the full rate (no warm-up), one checkpoint
TEACHER_RUN = dict(steps=2, warmup=0, ckpt_every=2, keep=3)


ROUND = dict(student_steps=[2, 1], teacher_steps=2, steps_per_round=3, ckpt_every=2, keep=5, log_every=1,
             dtype="fp32", seed=3, ema_decay=0.5, quiet=True)


@pytest.fixture(scope="module")
def full_distillation(teacher_run, tmp_path_factory):
    teacher, cache = teacher_run
    out = tmp_path_factory.mktemp("distill") / "out"
    rounds = distill.distill(teacher, out, cache_dir=cache, **ROUND)
    return out, rounds


@pytest.mark.slow
def test_rounds_are_ordinary_runs_with_few_step_sampling_defaults(full_distillation, teacher_run):
    from elflow.runs.load import read_record
    from elflow.runs.record import Distillation

    out, rounds = full_distillation
    assert list(rounds) == [2, 1] and rounds[2] == out / "2-step" and rounds[1] == out / "1-step"
    teacher = read_record(teacher_run[0])
    for n in (2, 1):
        net = elflow.load(out / f"{n}-step")
        assert net.origin.path.endswith("step_0000003")
        record = net.record
        assert record.distillation == Distillation("pd", n, 2)
        assert record.sampling.to_dict() == {**record.sampling.to_dict(), **distilled_defaults(n)}
        # the round's record is its own, with the teacher's recipe
        stored = json.loads((out / f"{n}-step" / "run.json").read_text())
        assert stored["record"]["distillation"] == {"objective": "pd", "student_steps": n, "teacher_steps": 2}
        assert "distillation" not in stored["train"]  # once: in the record
        assert record.recipe == teacher.recipe
    run1 = json.loads((out / "1-step" / "run.json").read_text())["train"]
    run2 = json.loads((out / "2-step" / "run.json").read_text())["train"]
    assert run2["init_from"].startswith(str(teacher_run[0]))  # round 1: the teacher
    assert run1["init_from"] == str(out / "2-step")  # round k + 1: round k's student (its EMA)
    assert run1["warmup_frac"] == 0.1 and run1["ema_decay"] == 0.5
    recs = [json.loads(r) for r in (out / "1-step" / "metrics.jsonl").read_text().splitlines()]
    lr = 1e-3 * 4 / 256  # a warm-up of ceil(0.1 x 3) = 1 step: the first at rate 0
    assert [r["step"] for r in recs] == [1, 2, 3] and [r["lr"] for r in recs] == pytest.approx([0.0, lr, lr])


@pytest.mark.slow
def test_each_round_reports_its_own_final_loss_and_names_the_folder_of_its_student(teacher_run, tmp_path, capsys):
    """Messages and folders agree: round i trains the n-step student in OUT/n-step, and its last line gives the
    final loss of that round's own metrics.jsonl."""
    from elflow.runs.log import training_records

    teacher, cache = teacher_run
    out = tmp_path / "out"
    distill.distill(teacher, out, cache_dir=cache, **{**ROUND, "quiet": False})
    done = [line for line in capsys.readouterr().err.splitlines() if ": done, " in line]
    assert len(done) == 2
    for i, (n, line) in enumerate(zip((2, 1), done)):
        last = training_records(out / f"{n}-step")[-1]
        assert line.startswith(f"round {i + 1} of 2, the {n}-step student ({out / f'{n}-step'}): done, step 3, "
                               f"final loss {last['loss']:.4g} (denoising {last['loss_denoise']:.4g}")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["1-step", "2-step"]


def test_a_round_whose_ema_stays_at_its_start_says_so_and_an_earlier_layout_keeps_its_folders(tmp_path, capsys):
    distill.warn_still_at_start(0.9999, 20)  # the next round would start from (almost) this round's start
    assert "still 100% the weights it started from" in capsys.readouterr().err
    distill.warn_still_at_start(0.5, 3)
    assert capsys.readouterr().err == ""
    (tmp_path / "round-4").mkdir()
    (tmp_path / "round-4" / "run.json").write_text("{}")
    assert distill.round_dir(tmp_path, 4) == tmp_path / "round-4"  # a distillation made before: resumed there
    assert distill.round_dir(tmp_path, 2) == tmp_path / "2-step"


@pytest.mark.slow
def test_an_interrupted_distillation_resumes_bit_identically(full_distillation, teacher_run, tmp_path):
    teacher, cache = teacher_run
    full, _ = full_distillation
    out = tmp_path / "out"
    distill.distill(teacher, out, cache_dir=cache, stop_after=4, **ROUND)  # round 2 done, one step into round 1
    assert (out / "1-step" / "checkpoints" / "step_0000001").exists()
    assert not (out / "1-step" / "checkpoints" / "step_0000003").exists()
    distill.distill(teacher, out, cache_dir=cache, resume=True, **ROUND)
    for n in (2, 1):
        for a, b in zip(_files(out / f"{n}-step", 3), _files(full / f"{n}-step", 3)):
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) for k in a), n


@pytest.mark.slow
def test_init_from_starts_from_the_stored_ema(teacher_run, tmp_path, tiny_t5_dir, tiny_corpus_file):
    from elflow.config import TrainConfig
    from elflow.train import train

    teacher, cache = teacher_run
    run = tmp_path / "run"
    cfg = TrainConfig(preset="tiny", data=str(tiny_corpus_file), space=f"t5:{tiny_t5_dir}", length=16, batch=4,
                      steps=1, warmup=1, ema_decay=0.9, lr=1e-30, log_every=1, ckpt_every=1, dtype="fp32", seed=5,
                      init_from=str(teacher))
    train(cfg, run, cache_dir=cache, quiet=True)
    model, ema = _files(run, 1)
    _, teacher_ema = _files(teacher, 2)
    teacher_model, _ = _files(teacher, 2)
    assert all(torch.equal(model[k], teacher_ema[k]) for k in teacher_ema)  # lr 1e-30: the start weights stay (updates vanish in fp32)
    assert all(torch.equal(ema[k], teacher_ema[k]) for k in teacher_ema)  # a fresh EMA of those weights
    assert any(not torch.equal(teacher_model[k], teacher_ema[k]) for k in teacher_ema)  # EMA, not raw weights


def _distill_argv(teacher, out, cache, *extra):
    return ["distill", str(teacher), "--out", str(out), "--cache-dir", str(cache), "--quiet", "--dtype", "fp32",
            "--batch", "4", *extra]


@pytest.mark.parametrize("extra, message", [
    (["--student-steps", "2,2", "--teacher-steps", "4"], "decrease strictly"),
    (["--student-steps", "1,2", "--teacher-steps", "4"], "decrease strictly"),
    (["--student-steps", "4,3", "--teacher-steps", "8"], "do not divide"),
    (["--student-steps", "two"], "comma-separated"),
    (["--student-steps", "1", "--teacher-steps", "1", "--latent-std", "0.5"], "embedding space"),
    (["--student-steps", "1", "--teacher-steps", "1", "--predict", "eps"], "distil with --predict x"),
])
def test_bad_distillation_input_is_one_line_and_writes_nothing(teacher_run, tmp_path, capsys, extra, message):
    teacher, cache = teacher_run
    out = tmp_path / "out"
    rc, _, err = cli(capsys, _distill_argv(teacher, out, cache, "--steps-per-round", "1", *extra))
    assert rc == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("elflow distill: error:") and message in lines[0]
    assert not out.exists()


def test_resume_into_another_distillation_is_refused(full_distillation, teacher_run, capsys):
    teacher, cache = teacher_run
    out, _ = full_distillation
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    manifest = (out / "distill.json").read_bytes()
    rc, _, err = cli(capsys, _distill_argv(teacher, out, cache, "--student-steps", "4,2,1", "--teacher-steps", "4",
                                 "--steps-per-round", "3", "--resume"))
    assert rc == 2 and "holds another distillation" in err and len(err.strip().splitlines()) == 1
    rc, _, err = cli(capsys, _distill_argv(teacher, out, cache, "--student-steps", "2,1", "--teacher-steps", "2",
                                 "--steps-per-round", "3"))
    assert rc == 2 and "already holds a distillation" in err
    assert (out / "distill.json").read_bytes() == manifest
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_a_teacher_without_ema_teaches_with_its_raw_weights_and_a_warning(teacher_run, tmp_path, capsys):
    import shutil

    teacher, cache = teacher_run
    run = tmp_path / "no_ema"  # the run copied, its checkpoint without EMA weights
    shutil.copytree(teacher, run)
    ck = run / "checkpoints" / "step_0000002"
    (ck / "ema.safetensors").unlink()
    state = json.loads((ck / "state.json").read_text())
    del state["files"]["ema.safetensors"]
    write_state(ck, state)
    out = tmp_path / "out"
    rc, _, err = cli(capsys, _distill_argv(ck, out, cache, "--student-steps", "1", "--teacher-steps", "1",
                                 "--steps-per-round", "1", "--ckpt-every", "1", "--lr", "1e-9"))
    assert rc == 0 and "holds no EMA weights" in err
    assert json.loads((out / "distill.json").read_text())["teacher_ema"] is False
    # the round started from the raw weights (one step at lr 1e-9 since), not from the teacher's EMA
    raw = load_file(ck / "model.safetensors")
    _, ema = _files(teacher, 2)
    model, _ = _files(out / "1-step", 1)

    def dist(a):
        return sum((model[k] - a[k]).pow(2).sum().item() for k in a)

    assert dist(raw) < 1e-6 * dist(ema)


@pytest.mark.slow
def test_init_from_a_network_of_another_shape_is_refused(teacher_run, tmp_path, capsys, tiny_t5_dir,
                                                         tiny_corpus_file):
    teacher, cache = teacher_run
    out = tmp_path / "run"
    rc, _, err = cli(capsys, ["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space",
                              f"t5:{tiny_t5_dir}", "--length", "16", "--batch", "4", "--steps", "1", "--warmup", "1",
                              "--depth", "3", "--dtype", "fp32", "--init-from", str(teacher), "--out", str(out),
                              "--cache-dir", str(cache)])
    assert rc == 2 and "another shape" in err and "depth 2 vs 3" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_sample_uses_the_stored_few_step_defaults(full_distillation, teacher_run, tmp_path, capsys):
    out, _ = full_distillation
    teacher, _ = teacher_run
    for src, extra, expect in [(out / "1-step", [], (1, 1.5, 2.5)), (out / "1-step", ["--steps", "3"], (3, 1.5, 2.5)),
                               (teacher, ["--steps", "2"], (2, 1.5, 3.0))]:
        dest = tmp_path / "s.jsonl"
        rc, _, err = cli(capsys, ["sample", str(src), "--num", "1", "--quiet", "--device", "cpu", "--out", str(dest),
                      "--overwrite", *extra])
        rec = json.loads(dest.read_text().splitlines()[0])
        assert rc == 0 and (rec["steps"], rec["gamma"], rec["omega"]) == expect, err


@pytest.mark.slow
def test_a_distillation_killed_with_sigkill_resumes_bit_identically(teacher_run, tmp_path):
    """As for training: SIGKILL after a checkpoint mid-round, --resume, the same weights as a run that was
    never stopped."""
    import os
    import signal
    import subprocess
    import sys
    import time

    teacher, cache = teacher_run
    settings = dict(student_steps=[2, 1], teacher_steps=2, steps_per_round=40, ckpt_every=2, keep=50, log_every=1,
                    dtype="fp32", seed=3, ema_decay=0.5, quiet=True)
    full = tmp_path / "full"
    distill.distill(teacher, full, cache_dir=cache, stop_after=6, **settings)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "elflow.cli", "distill", str(teacher), "--student-steps", "2,1",
           "--teacher-steps", "2", "--steps-per-round", "40", "--ckpt-every", "2", "--keep", "50", "--log-every",
           "1", "--dtype", "fp32", "--seed", "3", "--ema-decay", "0.5", "--quiet", "--out", str(out),
           "--cache-dir", str(cache)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / "2-step" / "checkpoints" / "step_0000002"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not first.exists():
            time.sleep(0.05)
        assert first.exists(), "no checkpoint appeared"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    from elflow.runs.checkpoint import latest_checkpoint

    done = int(latest_checkpoint(out / "2-step").name[5:])
    assert done >= 2
    if done < 6:  # (a very slow machine may have got past step 6 before the kill landed)
        distill.distill(teacher, out, cache_dir=cache, resume=True, stop_after=6 - done, **settings)
    for a, b in zip(_files(out / "2-step", 6), _files(full / "2-step", 6)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_distillation_report_puts_teacher_and_students_side_by_side(full_distillation, teacher_run):
    from elflow.experiments.quickstart import distillation_report

    out, rounds = full_distillation
    teacher, cache = teacher_run
    lines = []
    rep = distillation_report(teacher, rounds, num=2, cache_dir=cache, printer=lines.append)
    got = [(r["model"], r["steps"]) for r in rep["rows"]]
    assert got == [("teacher", 1), ("teacher", 2), ("teacher", 4), ("student (2 steps)", 2), ("student (1 steps)", 1)]
    assert all(r["sampler"] == "sde" and r["gamma"] == 1.5 and r["omega"] == 2.5 for r in rep["rows"])
    assert all(0 <= r["decode_accuracy"] <= 1 and 0 <= r["corpus_word_share"] <= 1 for r in rep["rows"])
    assert (out / "report.json").exists() and any("held-out text" in line for line in lines)


@pytest.mark.slow
def test_two_gloo_ranks_distil_as_one_process(teacher_run, tmp_path):
    """Under torchrun each round is an ordinary data-parallel run: two Gloo ranks give the weights of one
    process with the same global batch."""
    from helpers import run_alone_and_on_two_ranks

    teacher, cache = teacher_run
    common = ["distill", str(teacher), "--student-steps", "2,1", "--teacher-steps", "2", "--steps-per-round", "2",
              "--batch", "4", "--micro-batch", "2", "--ckpt-every", "2", "--dtype", "fp32", "--seed", "2",
              "--quiet", "--cache-dir", str(cache)]
    one, two = tmp_path / "one", tmp_path / "two"
    run_alone_and_on_two_ranks(common, one, two)
    for n in (2, 1):
        for a, b in zip(_files(one / f"{n}-step", 2), _files(two / f"{n}-step", 2)):
            assert a.keys() == b.keys()
            assert all(torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4) for k in a), n
