"""A flow-map student of an ELF teacher: its network (the teacher's with a target time, starting as the teacher),
its objective's time derivative against finite differences through the real network, and the command that
distils one, samples it at any step count, resumes it exactly and refuses what it cannot do."""

import json
import shutil

import pytest
import torch
from helpers import assert_one_error, checkpoint_weights, readout_without_specials, tree_state

import elflow
from elflow.cli import main
from elflow.flow import Recipe, euler_step, time_grid
from elflow.flowmap import map_and_time_derivative
from elflow.methods.lmd import draw_map_noise, map_loss
from elflow.model import ELF, get_config
from elflow.sampler import integrate


def pair():
    """(teacher, student): the student's weights the teacher's, its target time's embedding at zero."""
    torch.manual_seed(0)
    teacher = ELF(get_config("tiny", max_length=12)).eval().requires_grad_(False)
    torch.nn.init.normal_(teacher.x_head.weight, std=0.1)  # (zero-initialised; a trained one is not)
    student = ELF(get_config("tiny", max_length=12, target_time=True))
    missing = student.load_state_dict(teacher.state_dict(), strict=False).missing_keys
    assert missing and all(k.startswith("target_embed.") for k in missing)
    return teacher, student


def test_a_student_starts_as_its_teacher_whatever_the_target():
    teacher, student = pair()
    z, t, w = torch.randn(3, 12, 32), torch.rand(3), torch.ones(3)
    slot = torch.randn(3, 12, 32)
    for target in (t, torch.rand(3), torch.ones(3)):
        assert torch.equal(student(z, t, w, slot, target=target), teacher(z, t, w, slot))
    assert torch.equal(student.decode(z, w), teacher.decode(z, w))
    with pytest.raises(ValueError, match="takes none"):
        teacher(z, t, w, slot, target=t)


def test_the_maps_time_derivative_through_the_network_equals_finite_differences():
    """dX/dt by forward-mode autodiff through the whole ELF network (attention included) against a central
    difference of the map (fp32, the network's own precision: step 1e-3), with the target's embedding no longer
    zero."""
    _, student = pair()
    with torch.no_grad():
        for p in student.target_embed.parameters():
            p.normal_(std=0.3)
    z, s = torch.randn(2, 12, 32), torch.tensor([0.1, 0.4])
    omega, slot = torch.ones(2), torch.zeros(2, 12, 32)

    def net(z_, s_, t_):
        return student(z_, s_, omega, slot, target=t_)

    t = torch.tensor([0.3, 0.9])
    X, dX = map_and_time_derivative(net, z, s, t)
    h = 1e-3
    fd = (euler_step(z, s, t + h, net(z, s, t + h)) - euler_step(z, s, t - h, net(z, s, t - h))) / (2 * h)
    assert torch.allclose(X, euler_step(z, s, t, net(z, s, t)), atol=1e-5)  # (attention: another kernel)
    assert (dX - fd).abs().max() < 2e-3 * fd.abs().max() and fd.abs().max() > 0.1
    fd_wrong = (euler_step(z, s, t + h, net(z, s, t)) - euler_step(z, s, t - h, net(z, s, t))) / (2 * h)
    assert (dX - fd_wrong).abs().max() > 0.05 * fd.abs().max()  # the network's own dependence on t counts


def test_the_objective_trains_the_target_input_and_keeps_known_positions():
    teacher, student = pair()
    B, L, C = 8, 12, 32
    x, tokens = torch.randn(B, L, C), torch.randint(0, 100, (B, L))
    known = torch.zeros(B, L, dtype=torch.bool)
    known[:, :3] = True
    d = draw_map_noise((B, L, C), Recipe(), torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))
    loss, rows = map_loss(student, teacher, x, tokens, d, known=known)
    loss.backward()
    assert torch.isfinite(loss) and student.target_embed.fc2.weight.grad.abs().sum() > 0
    assert (rows["denoise"][~d.decode] > 0).all() and d.decode.any()


def test_the_map_sampler_jumps_only_with_a_student_and_lands_on_the_guess():
    teacher, student = pair()
    z0, w = 2 * torch.randn(2, 12, 32), torch.ones(2)
    with torch.no_grad():
        z, x = integrate(student, z0, time_grid(1, "uniform"), sampler="map", omega=w)
        assert torch.allclose(z, x, atol=1e-6)  # one jump from 0 to 1 lands on the guess
        z2, _ = integrate(teacher, z0, time_grid(1, "uniform"), sampler="ode", omega=w)
        assert torch.allclose(z, z2, atol=1e-6)  # at the start, the student's jump is the teacher's Euler step
        with pytest.raises(ValueError, match="takes none"):
            integrate(teacher, z0, time_grid(1, "uniform"), sampler="map", omega=w)


# the module's teacher (conftest.teacher_run): four steps, one checkpoint
TEACHER_RUN = dict(steps=4, ckpt_every=4)


def distil(teacher_run, out, *extra):
    teacher, cache = teacher_run
    return main(["distill", str(teacher), "--objective", "flow-map", "--steps", "4", "--ckpt-every", "2",
                 "--cache-dir", str(cache), "--out", str(out), "--quiet", *extra])


def test_distill_flow_map_makes_one_student_that_samples_at_any_step_count(teacher_run, tmp_path, capsys, tiny_t5_dir):
    out = tmp_path / "fm"
    assert distil(teacher_run, out) == 0
    readout_without_specials(out, tiny_t5_dir)  # four steps of training may end every sample at once
    net = elflow.load(out)
    record = net.record
    assert net.config.target_time and record.distillation.objective == "flow-map"
    assert (record.sampling.sampler, record.sampling.steps, record.sampling.grid) == ("map", 4, "uniform")
    texts = {}
    for k in (1, 2, 7):
        f = tmp_path / f"s{k}.jsonl"
        assert main(["sample", str(out), "--steps", str(k), "--num", "2", "--quiet", "--out", str(f)]) == 0
        recs = [json.loads(line) for line in f.read_text().splitlines()]
        assert [r["steps"] for r in recs] == [k, k] and recs[0]["sampler"] == "map"
        texts[k] = [r["text"] for r in recs]
    capsys.readouterr()
    code = main(["sample", str(out), "--steps", "65", "--out", str(tmp_path / "x.jsonl")])
    assert_one_error(code, capsys.readouterr().err, "sample", "1 to 64 steps")
    code = main(["sample", str(teacher_run[0]), "--sampler", "map", "--out", str(tmp_path / "x.jsonl")])
    assert_one_error(code, capsys.readouterr().err, "sample", "flow-map student")
    # a student does not teach a student
    code = main(["distill", str(out), "--objective", "flow-map", "--steps", "2", "--out", str(tmp_path / "again")])
    assert_one_error(code, capsys.readouterr().err, "distill", "distilled student")
    code = main(["distill", str(out), "--student-steps", "1", "--teacher-steps", "2", "--out", str(tmp_path / "pd")])
    assert_one_error(code, capsys.readouterr().err, "distill", "is a flow-map student; progressive distillation")
    assert not (tmp_path / "again").exists() and not (tmp_path / "pd").exists()


@pytest.mark.slow
def test_a_stopped_flow_map_distillation_resumes_exactly(teacher_run, tmp_path):
    from elflow.distill import distill_flow_map

    teacher, cache = teacher_run
    full, part = tmp_path / "full", tmp_path / "part"
    kw = dict(ckpt_every=2, cache_dir=cache, quiet=True)
    distill_flow_map(teacher, full, steps=4, **kw)
    distill_flow_map(teacher, part, steps=4, stop_after=2, **kw)
    assert not (part / "checkpoints" / "step_0000004").exists()
    distill_flow_map(teacher, part, steps=4, resume=True, **kw)
    for a, b in zip(checkpoint_weights(full, 4), checkpoint_weights(part, 4)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    shutil.rmtree(part)


def test_pd_flags_are_refused_and_a_resume_names_the_setting_it_would_change(teacher_run, tmp_path, capsys):
    """--teacher-steps sets progressive distillation's teacher sub-steps; the flow map learns from the teacher's
    velocity and takes none: refused, on a start and on a --resume, in one line that writes nothing. A resume with
    another setting of the student is refused naming it."""
    out = tmp_path / "fm"
    code = distil(teacher_run, out, "--teacher-steps", "9999")
    assert_one_error(code, capsys.readouterr().err, "distill", "--teacher-steps 9999", "--objective pd",
                     "drop --teacher-steps")
    assert not out.exists()
    assert distil(teacher_run, out, "--steps", "2") == 0
    before = tree_state(out)
    code = distil(teacher_run, out, "--steps", "6", "--teacher-steps", "4", "--resume")
    assert_one_error(code, capsys.readouterr().err, "distill", "--teacher-steps 4", "drop --teacher-steps")
    for flag, value, named in (("--lr", "0.01", "lr: "), ("--student-steps", "8", "distillation.student_steps: 4 -> 8"),
                               ("--warmup-frac", "0.5", "warmup_frac: 0.1 -> 0.5")):
        code = distil(teacher_run, out, "--steps", "6", flag, value, "--resume")
        assert_one_error(code, capsys.readouterr().err, "distill", "holds a different run", named)
    assert tree_state(out) == before


def test_a_teacher_still_training_is_read_once_so_a_pruned_checkpoint_does_not_matter(teacher_run, tmp_path,
                                                                                        monkeypatch):
    """A distillation reads its teacher once: a teacher run that is still training may prune (--keep) the very
    checkpoint that was read before the students start; both objectives go on from the weights read, and the
    student is the one a distillation of the untouched teacher makes, bit for bit."""
    import elflow.distill as distill_module

    real = distill_module.read_teacher

    def read_then_prune(path):
        read = real(path)
        shutil.rmtree(read.origin.path)  # what --keep of the training run does meanwhile
        return read

    kw = dict(cache_dir=teacher_run[1], quiet=True, ckpt_every=1)
    untouched = distill_module.distill(teacher_run[0], tmp_path / "pd0", student_steps=(1,), teacher_steps=2,
                                       steps_per_round=1, **kw)[1]
    monkeypatch.setattr(distill_module, "read_teacher", read_then_prune)
    for objective in ("flow-map", "pd"):
        teacher = tmp_path / f"teacher-{objective}"
        shutil.copytree(teacher_run[0], teacher)
        if objective == "flow-map":
            distill_module.distill_flow_map(teacher, tmp_path / "fm", steps=1, **kw)
            continue
        pruned = distill_module.distill(teacher, tmp_path / "pd", student_steps=(1,), teacher_steps=2,
                                        steps_per_round=1, **kw)[1]
        for a, b in zip(checkpoint_weights(untouched, 1), checkpoint_weights(pruned, 1)):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
