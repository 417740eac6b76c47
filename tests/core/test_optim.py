"""Muon's Newton-Schulz: both evaluations against an SVD, against torch's own, and through a real Muon step."""

import copy
import math

import pytest
import torch
import torch.optim._muon as muon_impl
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from elflow.experiments.bench import newton_schulz_flops
from elflow.newton_schulz import method_for, newton_schulz, ns_precision, resolve_ns_method
from elflow.optim import ELFOptimizer, check_optimizer_state, head_transposed_factor
from elflow.util.devices import fast_bf16

COEF = (3.4445, -4.7750, 2.0315)


def svd_reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Five quintic steps act on each singular value alone: U phi^5(S / |g|_F) V^T, in float64."""
    a, b, c = COEF
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    s = s / g.double().norm()
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return (u * s) @ vh


def ill_conditioned(m: int, n: int, lo: float = 1e-6, rank: int | None = None) -> torch.Tensor:
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64))
    s = torch.logspace(0, torch.log10(torch.tensor(lo)).item(), k, dtype=torch.float64)
    if rank is not None:
        s[rank:] = 0
    return ((u * s) @ v.T).float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(40, 40), (24, 90), (130, 36)])
@pytest.mark.parametrize("method", ["iterate", "spectral"])
def test_both_methods_equal_the_svd_evaluation(shape, method):
    """Exact in float64. In fp32 the spectral form squares the condition number (it diagonalises X X^T), so on
    matrices whose singular values span 1e-6..1 it is ~1e-3 off where the iteration is ~1e-5 off; both stay
    far closer than torch's own bf16 iteration (the GPU default the issue accepts), which is 1e-2..0.5 off."""
    torch.manual_seed(0)
    for g in (torch.randn(*shape), ill_conditioned(*shape), ill_conditioned(*shape, rank=5)):
        ref = svd_reference(g)
        assert rel(newton_schulz(g.double(), dtype=torch.float64, method=method), ref) < 1e-9
        err = rel(newton_schulz(g, dtype=torch.float32, method=method), ref)
        bf16 = rel(newton_schulz(g, dtype=torch.bfloat16).float(), ref)
        assert err < (1e-4 if method == "iterate" else 1e-2) and err < bf16 / 4
        out = newton_schulz(g, method=method)
        assert out.shape == g.shape and out.dtype == torch.float32


def test_iterate_is_torchs_newton_schulz():
    """torch's private step runs in bf16; ours in fp32 must agree to bf16 accuracy, and spectral with it."""
    torch.manual_seed(1)
    g = torch.randn(64, 160)
    theirs = muon_impl._zeropower_via_newtonschulz(g, COEF, 5, 1e-7).float()
    assert rel(newton_schulz(g), theirs) < 3e-2
    assert rel(newton_schulz(g, method="spectral"), theirs) < 3e-2


def test_spectral_falls_back_on_non_finite_input_and_zero_is_zero():
    bad = torch.randn(8, 12)
    bad[2, 3] = float("nan")
    assert torch.isnan(newton_schulz(bad, method="spectral")).all()  # as the iteration gives, no exception
    assert torch.equal(newton_schulz(torch.zeros(6, 9), method="spectral"), torch.zeros(6, 9))
    with pytest.raises(ValueError, match="iterate, spectral or by-shape"):
        newton_schulz(bad, method="svd")


def test_spectral_in_bf16_computes_in_fp32_and_returns_bf16():
    g = torch.randn(16, 40)
    out = newton_schulz(g, dtype=torch.bfloat16, method="spectral")
    assert out.dtype == torch.bfloat16 and rel(out.float(), svd_reference(g)) < 1e-2


def test_resolve_by_shape_rule_and_flop_formula():
    assert resolve_ns_method("auto", torch.float32, "cpu") == "by-shape"
    assert resolve_ns_method("auto", torch.bfloat16, "cpu") == "iterate"
    assert resolve_ns_method("iterate", torch.float32, "cpu") == "iterate"
    with pytest.raises(ValueError, match="auto, iterate, spectral"):
        resolve_ns_method("fast", torch.float32, "cpu")
    # by-shape: large or elongated matrices spectrally, small square ones by iteration
    assert [method_for(s, "by-shape") for s in [(768, 768), (32100, 512), (128, 512), (256, 256), (64, 256)]] == \
        ["spectral", "spectral", "spectral", "iterate", "iterate"]
    g = torch.randn(64, 256)
    assert torch.equal(newton_schulz(g, method="by-shape"), newton_schulz(g, method="iterate"))
    g = torch.randn(600, 40)
    assert torch.equal(newton_schulz(g, method="by-shape"), newton_schulz(g, method="spectral"))
    for m, n in [(48, 80), (96, 32)]:
        with FlopCounterMode(display=False) as fc:  # counts the three matmuls; eigh is counted as 9 k^3
            newton_schulz(torch.randn(m, n), method="spectral")
        k = min(m, n)
        assert fc.get_total_flops() + 9 * k ** 3 == newton_schulz_flops([(m, n)], method="spectral")
    shapes = [(768, 768), (256, 256)]
    assert newton_schulz_flops(shapes, method="by-shape") == \
        newton_schulz_flops(shapes[:1], method="spectral") + newton_schulz_flops(shapes[1:])
    # the reason for spectral: the ELF readout costs 4.4x fewer FLOPs
    assert newton_schulz_flops([(32100, 512)]) / newton_schulz_flops([(32100, 512)], method="spectral") > 4


def small_net() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.Tanh(), torch.nn.Linear(48, 6))


def flat(net) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def test_muon_step_is_the_same_with_either_method_and_torch_is_restored():
    original = muon_impl._zeropower_via_newtonschulz
    start, results = flat(small_net()), {}
    x = torch.randn(32, 20, generator=torch.Generator().manual_seed(4))
    for dtype, method in ((torch.float32, "iterate"), (torch.float32, "spectral"), (torch.bfloat16, "iterate")):
        net = small_net()
        opt = ELFOptimizer(net.named_parameters(), lr=0.05, ns_dtype=dtype, ns_method=method, update_rule="torch-fan")
        assert opt.ns_method == method and len(opt.optimizers) == 2  # Muon for weights, Adam for biases
        for _ in range(3):
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        results[method if dtype == torch.float32 else "bf16"] = flat(net)
        assert muon_impl._zeropower_via_newtonschulz is original
    moved = (results["iterate"] - start).norm()
    assert moved > 0.1  # the steps did something
    spectral_off = (results["spectral"] - results["iterate"]).norm()
    assert spectral_off < 1e-3 * moved and spectral_off < (results["bf16"] - results["iterate"]).norm() / 4
    expected = "iterate" if fast_bf16("cpu") else "by-shape"  # bf16 Newton-Schulz iterates on AMX CPUs
    assert ELFOptimizer(torch.nn.Linear(4, 4).named_parameters(), lr=0.1, update_rule="torch-fan").ns_method == expected
    assert ELFOptimizer(torch.nn.Linear(4, 4).named_parameters(), lr=0.1).ns_dtype == torch.float32  # released
    with ns_precision(torch.float32, "spectral"):
        assert muon_impl._zeropower_via_newtonschulz is not original
    assert muon_impl._zeropower_via_newtonschulz is original


def released_rate(k: int, lr: float, warmup: int, decay: str = "constant", total: int | None = None) -> float:
    """The released schedule written out: optax's linear_schedule(0 -> lr over W) joined at W with a constant
    or a cosine_decay_schedule(decay_steps = total - W), alpha 0."""
    if k < warmup:
        return lr * k / warmup
    if decay == "constant":
        return lr
    return lr * (1 + math.cos(math.pi * min(1.0, (k - warmup) / (total - warmup)))) / 2


@pytest.mark.parametrize("warmup", [0, 1, 2, 10, 37])
@pytest.mark.parametrize("decay", ["constant", "cosine"])
def test_the_schedule_is_the_released_one(warmup, decay):
    from elflow.schedule import lr_at

    lr, total = 3e-3, 110
    got = [lr_at(k, lr, warmup, decay, total) for k in range(total + 5)]
    want = [released_rate(k, lr, warmup, decay, total) for k in range(total + 5)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    if warmup:
        assert got[0] == 0.0  # the first step only fills the momentum and the Adam moments
    if decay == "cosine":
        assert got[total - 1] > 0 and got[total] == pytest.approx(0.0, abs=1e-15)


def test_the_earlier_schedule_runs_one_step_ahead():
    from elflow.schedule import lr_at

    lr, warm, total = 3e-3, 10, 110
    ahead = [lr_at(k, lr, warm, "cosine", total, schedule="one-ahead") for k in range(total)]
    assert ahead[:warm] == pytest.approx([lr * (k + 1) / warm for k in range(warm)], rel=1e-12)
    assert ahead[warm:total - 1] == pytest.approx([released_rate(k + 1, lr, warm, "cosine", total)
                                                   for k in range(warm, total - 1)], rel=1e-12)
    assert ahead[-1] == 0.0
    assert [lr_at(k, lr, warm, schedule="one-ahead") for k in (0, 9, 10, 109)] == [lr / 10, lr, lr, lr]
    with pytest.raises(ValueError):
        lr_at(50, lr, warm, "cosine")  # no total
    with pytest.raises(ValueError):
        lr_at(5, lr, warm, schedule="early")


# ---------------------------------------------------------------------------------------------------------
# the released update against an independent implementation of its formulas


class KernelNet(torch.nn.Module):
    """A matrix stored (out, in) as nn.Linear stores it, one stored (in, out) as the authors' decode head
    stores its kernels, a vector for Adam, and a branch (`side`) that gets gradients only when it is used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        g = torch.Generator().manual_seed(5)
        self.lin = torch.nn.Linear(6, 10)  # (out, in) = (10, 6): sqrt(10 / 6)
        self.kernel = torch.nn.Parameter(torch.randn(10, 24, generator=g) * 0.3)  # (in, out): sqrt(24 / 10)
        self.gain = torch.nn.Parameter(1 + 0.1 * torch.randn(24, generator=g))
        self.side = torch.nn.Linear(6, 24)

    def forward(self, x, use_side: bool):
        y = (torch.tanh(self.lin(x)) @ self.kernel) * self.gain
        return y + self.side(x) if use_side else y


def reference_released_steps(net: torch.nn.Module, in_out: set, batches, lr: float) -> dict:
    """The released update written from its formulas alone, in float64, on a float64 copy of `net`."""
    b, (b1, b2), a_b_c = 0.95, (0.9, 0.999), (3.4445, -4.7750, 2.0315)
    net = copy.deepcopy(net).double()
    m = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    v = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    for t, (x, target, use_side) in enumerate(batches, start=1):
        net.zero_grad(set_to_none=True)
        (net(x.double(), use_side) - target.double()).pow(2).mean().backward()
        with torch.no_grad():
            for n, p in net.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)  # no gradient: a zero one
                if p.ndim == 2:
                    m[n] = m[n] + (1 - b) * (g - m[n])
                    u = b * m[n] / (1 - b ** (t + 1)) + (1 - b) * g / (1 - b ** t)
                    wide = u if u.shape[0] <= u.shape[1] else u.T
                    X = wide / (torch.linalg.matrix_norm(wide) + 1e-8)
                    for _ in range(5):
                        A = X @ X.T
                        X = a_b_c[0] * X + (a_b_c[1] * A + a_b_c[2] * A @ A) @ X
                    X = X if u.shape[0] <= u.shape[1] else X.T
                    fan_in, fan_out = p.shape if n in in_out else p.shape[::-1]
                    p -= lr * math.sqrt(max(1.0, fan_out / fan_in)) * X
                else:
                    m[n] = b1 * m[n] + (1 - b1) * g
                    v[n] = b2 * v[n] + (1 - b2) * g * g
                    m_hat = b1 * m[n] / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1 ** t)
                    p -= lr * m_hat / ((v[n] / (1 - b2 ** t)).sqrt() + 1e-8)
    return {n: p.detach() for n, p in net.named_parameters()}


def steps_of(rule: str, in_out=("kernel",), ns_method: str = "iterate"):
    """(elflow's weights after three steps, the reference's), the side branch used in the first step only."""
    net, gen = KernelNet(), torch.Generator().manual_seed(6)
    batches = [(torch.randn(16, 6, generator=gen), torch.randn(16, 24, generator=gen), i == 0) for i in range(3)]
    expected = reference_released_steps(net, {"kernel"}, batches, lr=0.02)
    opt = ELFOptimizer(net.named_parameters(), lr=0.02, update_rule=rule, in_out=in_out, ns_method=ns_method)
    for x, target, use_side in batches:
        (net(x, use_side) - target).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in net.named_parameters()}, expected


def worst(mine: dict, expected: dict) -> tuple[float, str]:
    return max((rel(mine[n], expected[n]), n) for n in expected)


def test_the_released_update_equals_its_formulas_on_every_parameter():
    """Three steps: Muon on both matrices (one stored (in, out)), Nesterov-Adam on the vectors, and the side
    branch, whose gradients stop after the first step, still moving by its decaying moments."""
    mine, expected = steps_of("released")
    err, name = worst(mine, expected)
    assert err < 1e-6, name
    side = KernelNet().side
    assert (mine["side.weight"] - side.weight).norm() > 0.05  # it kept moving after step 1 (3 steps of 0.02)


def test_the_reference_tells_the_earlier_updates_and_a_misread_layout_apart():
    """The test can fail: torch's Muon and Adam (no bias correction, Adam without Nesterov, no step without a
    gradient) and the (in, out) matrix read as (out, in) are each far from the released update."""
    for rule, in_out in (("torch-fan", ()), ("released", ())):
        mine, expected = steps_of(rule, in_out)
        assert worst(mine, expected)[0] > 1e-3, (rule, in_out)


def test_the_released_update_evaluated_spectrally_stays_close():
    """The CPU's default evaluation of Newton-Schulz (by-shape: spectral for large matrices) computes the same
    polynomial; on these small matrices it is within fp32 rounding of the iteration."""
    mine, expected = steps_of("released", ns_method="spectral")
    assert worst(mine, expected)[0] < 1e-4


def test_the_released_update_resumes_exactly_from_its_state():
    """state_dict / load_state_dict in the middle of a run: the same weights as without the interruption."""
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(16, 6, generator=gen), torch.randn(16, 24, generator=gen), i % 2 == 0) for i in range(4)]

    def run(split: int | None):
        net = KernelNet()
        opt = ELFOptimizer(net.named_parameters(), lr=0.02, in_out=("kernel",))
        for i, (x, target, side) in enumerate(batches):
            if i == split:
                state = copy.deepcopy(opt.state_dict())
                opt = ELFOptimizer(net.named_parameters(), lr=0.02, in_out=("kernel",))
                opt.load_state_dict(state)
            (net(x, side) - target).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return flat(net)

    assert torch.equal(run(None), run(2))


def test_the_earlier_rules_scale_the_decode_head_as_they_did():
    """torch-fan: one Muon group at torch's fan scale; torch-head-transposed: the decode head's two matrices
    each in a group of their own at the factor (transpose's scale) / (fan scale)."""
    from elflow.model import ELF, get_config

    torch.manual_seed(0)
    net = ELF(get_config("tiny", max_length=16))  # decode head: proj (32, 64), unembed (100, 32)
    for rule, groups in (("torch-fan", 1), ("torch-head-transposed", 3)):
        opt = ELFOptimizer(list(net.named_parameters()), lr=1e-3, update_rule=rule)
        assert isinstance(opt.optimizers[0], torch.optim.Muon) and len(opt.optimizers[0].param_groups) == groups
        opt.set_lr(2e-3)
        lrs = sorted(g["lr"] for g in opt.optimizers[0].param_groups)
        expected = [2e-3] if rule == "torch-fan" else sorted([2e-3, 2e-3 * (100 / 32) ** -0.5, 2e-3 * 2 ** 0.5])
        assert lrs == pytest.approx(expected)
    assert head_transposed_factor("decode_head.unembed.weight", (32100, 512), "torch-head-transposed") == \
        pytest.approx((512 / 32100) ** 0.5)
    assert head_transposed_factor("blocks.0.attn.qkv.weight", (2304, 768), "torch-head-transposed") == 1.0
    assert head_transposed_factor("decode_head.unembed.weight", (32100, 512), "torch-fan") == 1.0
    with pytest.raises(ValueError, match="update_rule"):
        ELFOptimizer(list(net.named_parameters()), lr=1e-3, update_rule="fan")


def test_runs_stored_with_a_muon_scale_keep_their_update():
    from elflow.config import TrainConfig
    from elflow.runs.migrate import train_1_to_2

    def stored(d):  # a run description of version 1 of the record, as read back from run.json or state.json
        return TrainConfig.from_dict(train_1_to_2(d))

    assert TrainConfig().update_rule == "released"
    assert stored({}).update_rule == "torch-fan"  # stored before the setting existed: torch's Muon, fan rule
    assert stored({"muon_scale": "fan"}).update_rule == "torch-fan"
    assert stored({"muon_scale": "released"}).update_rule == "torch-head-transposed"
    assert stored({"optimizer": "adamw"}).update_rule == "released"  # no Muon: the default, unused
    assert stored({"update_rule": "released"}).update_rule == "released"


# ----------------------------------------------------------------------------------------------------------
# the stored state a resume loads: checked against the run's network and update rule before it is used

UPDATES = (("muon", "released"), ("muon", "torch-fan"), ("muon", "torch-head-transposed"), ("adamw", "released"))
_STEPPED: dict = {}


def stepped(kind: str, rule: str):
    """(the tiny network's named parameters, a fresh optimiser of `kind` and `rule` for them, a copy of the
    state of one that took two steps)."""
    from elflow.model import ELF, get_config

    if (kind, rule) not in _STEPPED:
        torch.manual_seed(0)
        named = list(ELF(get_config("tiny", max_length=16)).named_parameters())
        opt = ELFOptimizer(named, lr=1e-3, kind=kind, update_rule=rule, ns_method="iterate")
        for _ in range(2):
            for _, p in named:
                p.grad = torch.randn_like(p)
            opt.step()
            opt.zero_grad()
        _STEPPED[kind, rule] = named, opt.state_dict()
    named, state = _STEPPED[kind, rule]
    return named, ELFOptimizer(named, lr=1e-3, kind=kind, update_rule=rule, ns_method="iterate"), \
        copy.deepcopy(state)


def stored_parameters(opt: ELFOptimizer, named) -> list[tuple[int, int, str]]:
    """(part, index in the stored state, name) of every parameter of `opt`."""
    names = {id(p): n for n, p in named}
    out = []
    for k, part in enumerate(opt.optimizers):
        for stored, live in zip(part.state_dict()["param_groups"], part.param_groups):
            out += [(k, i, names[id(p)]) for i, p in zip(stored["params"], live["params"])]
    return out


@pytest.mark.parametrize("kind, rule", UPDATES)
def test_the_state_of_every_update_passes_its_check_and_loads(kind, rule):
    named, fresh, state = stepped(kind, rule)
    check_optimizer_state(fresh, state, named, "run/checkpoints/step_0000002/optimizer.pt", 2)
    fresh.load_state_dict(state)


def _transposed(t):
    return t.t().contiguous() if t.ndim == 2 and t.shape[0] != t.shape[1] else t.reshape(-1)[:-1].clone()


# a damage to one parameter's stored state -> what the line says
PARAMETER_DAMAGES = {
    "nan-moment": (lambda s, key: s[key].view(-1).__setitem__(0, float("nan")), "NaN or infinite"),
    "inf-moment": (lambda s, key: s[key].fill_(float("inf")), "NaN or infinite"),
    "transposed-moment": (lambda s, key: s.__setitem__(key, _transposed(s[key])), "has shape"),
    "moment-missing": (lambda s, key: s.pop(key), "holds no"),
    "integer-moment": (lambda s, key: s.__setitem__(key, s[key].long()), "not floating-point"),
    "step-negative": (lambda s, key: s.__setitem__("step", torch.tensor(-5.0)), "step count is -5"),
    "step-fraction": (lambda s, key: s.__setitem__("step", torch.tensor(1.5)), "step count is 1.5"),
    "step-nan": (lambda s, key: s.__setitem__("step", torch.tensor(float("nan"))), "step count is nan"),
    "step-beyond-the-checkpoint": (lambda s, key: s.__setitem__("step", torch.tensor(9.0)), "step count is 9"),
    "step-a-vector": (lambda s, key: s.__setitem__("step", torch.ones(2)), "not a number"),
    "step-missing": (lambda s, key: s.pop("step"), "no step count"),
    "not-a-record": (lambda s, key: s.clear() or s.update(x=1) or None, "holds no"),
}


@settings(max_examples=60, deadline=None)
@given(update=st.sampled_from(UPDATES), damage=st.sampled_from(sorted(PARAMETER_DAMAGES)),
       which=st.integers(min_value=0, max_value=10**6))
def test_a_damaged_parameter_state_is_one_line_naming_the_file_and_the_parameter(update, damage, which):
    """Whatever parameter's state is damaged, and however: an ELFError naming the file and that parameter,
    before anything is loaded (where the update keeps no step count, the step damages do not apply)."""
    from elflow.util.errors import ELFError

    named, fresh, state = stepped(*update)
    k, index, name = stored_parameters(fresh, named)[which % len(named)]
    entry = state[k]["state"][index]
    moment = next(key for key in ("m", "exp_avg", "momentum_buffer") if key in entry)
    if damage.startswith("step") and "step" not in entry:
        return
    change, words = PARAMETER_DAMAGES[damage]
    change(entry, moment)
    with pytest.raises(ELFError) as e:
        check_optimizer_state(fresh, state, named, "run/checkpoints/step_0000002/optimizer.pt", 2)
    line = str(e.value)
    assert "\n" not in line and line.startswith("run/checkpoints/step_0000002/optimizer.pt: ")
    assert f"parameter {name}:" in line and words in line, line
    assert line.endswith("--init-from run/checkpoints/step_0000002"), line


def test_a_changed_group_or_layout_is_one_line():
    """The 'muon' flag of a group flipped, a setting made NaN or dropped, a group lost or shortened, a part
    more: refused, naming what differs; under the released update, one parameter's step count behind the
    others' is refused too (every parameter steps at every step)."""
    from elflow.util.errors import ELFError

    def refused(state, *words, kind="muon", rule="released", fresh=None, named=None):
        with pytest.raises(ELFError) as e:
            check_optimizer_state(fresh, state, named, "ck/optimizer.pt", 2)
        for w in words:
            assert w in str(e.value), (w, str(e.value))

    for change, words in (
            (lambda s: s[0]["param_groups"][0].update(muon=False), ["group 1 has muon False", "True"]),
            (lambda s: s[0]["param_groups"][-1].update(betas=(float("nan"), 0.999)), ["has betas (nan, 0.999)"]),
            (lambda s: s[0]["param_groups"][0].pop("in_out"), ["group 1 has no setting 'in_out'"]),
            (lambda s: s[0]["param_groups"].pop(), ["holds 1 parameter groups, this run's update has 2"]),
            (lambda s: s[0]["param_groups"][0]["params"].pop(), ["group 1 holds", "parameters, this run's has"]),
            (lambda s: s.append(s[0]), ["it holds 2 optimiser states", "has 1"]),
            (lambda s: s[0]["state"].pop(0), ["its state is missing, while"]),
            (lambda s: s[0]["state"][3]["step"].fill_(1), ["step count is 1, the checkpoint's step is 2"])):
        named, fresh, state = stepped("muon", "released")
        change(state)
        refused(state, *words, fresh=fresh, named=named)
    named, fresh, state = stepped("muon", "torch-fan")
    refused(state[:1], "it holds 1 optimiser states", "torch-fan) has 2", fresh=fresh, named=named)
    state[0]["param_groups"][0]["nesterov"] = False
    refused(state, "its optimiser 1 of 2, group 1 has nesterov False", fresh=fresh, named=named)
    named, fresh, state = stepped("muon", "torch-fan")  # Adam's count may lag where a parameter had no gradient
    state[1]["state"][0]["step"].fill_(1)
    check_optimizer_state(fresh, state, named, "ck/optimizer.pt", 2)
