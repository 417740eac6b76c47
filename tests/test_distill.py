"""Progressive distillation: the teacher's side against the authors' vectors, the student's loss, the rounds."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elflow import distill

REF = Path(__file__).resolve().parents[2] / "shared" / "reference"
if not REF.exists():  # CI lays shared/ beside the clone
    REF = Path(__file__).resolve().parents[1].parent / "shared" / "reference"
HAVE_REF = (REF / "authors_cond_distill.safetensors").exists() and (REF / "official_tiny.safetensors").exists()
needs_ref = pytest.mark.skipif(not HAVE_REF, reason="shared/reference missing")

TOL = 1e-5


@pytest.fixture(scope="module")
def official_net():
    from elflow.official import build_from_state_dict, official_to_elflow

    ref = load_file(REF / "official_tiny.safetensors")
    sd = official_to_elflow({k[len("params."):]: v for k, v in ref.items() if k.startswith("params.")})
    return build_from_state_dict(sd, max_length=16).eval()


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


@needs_ref
def test_reference_case_has_rows_with_and_without_a_source(case):
    n_known = case["cond_seq_mask"].sum(-1)
    assert (n_known == 0).any() and (n_known > 0).any()
    assert case["use_self_cond"].bool().any() and (~case["use_self_cond"].bool()).any()


@needs_ref
@torch.no_grad()
def test_teacher_init_and_slot_match_the_authors(official_net, case):
    known = case["cond_seq_mask"].bool()
    init = distill.teacher_init(official_net, case["z_t_s"], case["t_s"], case["omega"], case["x0"], known)
    assert close(init, case["teacher_init"]) < TOL
    assert close(_slot(case, init), case["sc_half"]) < TOL


@needs_ref
@torch.no_grad()
@pytest.mark.parametrize("kind", ["sub_steps", "uniform", "one_step"])
def test_pd_target_matches_the_authors(official_net, case, kind):
    known = case["cond_seq_mask"].bool()
    K = case["sub_step_times"].shape[1] - 1
    steps, times = {"sub_steps": (K, case["sub_step_times"]), "uniform": (K, None), "one_step": (1, None)}[kind]
    target = distill.pd_target(official_net, case["z_t_s"], case["t_s"], case["t_t"], case["omega"],
                               case["sc_half"], case["x0"], known, steps, sub_step_times=times, t_eps=0.05)
    assert close(target, case[f"target_{kind}"]) < TOL
