"""How Muon's Newton-Schulz polynomial is evaluated: five iterations, or the same polynomial applied to the
eigenvalues of the Gram matrix (spectral), which is several times faster in fp32 on a CPU for the large
matrices. The released update runs it in fp32 (elflow.optim.ReleasedMuonAdam); the earlier torch-based updates
in bf16 on GPUs (as torch does) and fp32 on CPUs without native bf16 matrix units, `ns_precision` installing
the choice into torch.optim.Muon for one step. docs/internals.md ("the optimiser recipe") has the measurements'
reading."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.optim._muon as _muon_impl

from elflow.util.devices import fast_bf16

NS_METHODS = ("auto", "iterate", "spectral", "by-shape")


def spectral_pays(m: int, n: int) -> bool:
    """The by-shape rule: evaluate an m x n matrix spectrally iff k >= 384 or N >= max(2k, 512)."""
    k, big = min(m, n), max(m, n)
    return k >= 384 or big >= max(2 * k, 512)


def method_for(shape, method: str) -> str:
    """The evaluation (iterate or spectral) that a matrix of this shape gets under `method`."""
    if method == "by-shape":
        return "spectral" if spectral_pays(*shape) else "iterate"
    return method


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's a, b, c (Muon's, as released)


def newton_schulz(g: torch.Tensor, ns_coefficients=NS_COEFFICIENTS, ns_steps: int = 5,
                  eps: float = 1e-7, dtype: torch.dtype = torch.float32, method: str = "iterate",
                  added_eps: bool = False) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of g (m, n) in `dtype`, evaluated by `method`, starting from
    g / max(|g|_F, eps) as torch.optim.Muon does, or, with `added_eps`, from g / (|g|_F + eps) as the released
    optimiser does.

    The leading arguments match torch's private `_zeropower_via_newtonschulz(grad, coefficients, steps, eps)`,
    which always runs in bf16 and iterates. See the module docstring for the methods.
    """
    if method not in NS_METHODS[1:]:  # "auto" is resolved by the optimiser (resolve_ns_method)
        raise ValueError(f"Newton-Schulz method must be iterate, spectral or by-shape, got {method!r}")
    method = method_for(g.shape, method)
    a, b, c = ns_coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + eps) if added_eps else x / x.norm().clamp(min=eps)  # spectral norm <= 1
    if method == "spectral":  # eigh needs fp32 or wider
        wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
        out = _spectral_newton_schulz(wide, a, b, c, ns_steps)
        if out is not None:
            out = out.to(x.dtype)
            return out.T if tall else out
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _spectral_newton_schulz(x: torch.Tensor, a: float, b: float, c: float, steps: int) -> torch.Tensor | None:
    """X_steps = V h(diag l) V^T X for the wide, normalised x, G = x x^T = V diag(l) V^T; None if eigh fails."""
    gram = x @ x.T
    try:
        lam, vec = torch.linalg.eigh(gram)
    except RuntimeError:  # torch.linalg.LinAlgError (no convergence, non-finite input): iterate instead
        return None
    h = torch.ones_like(lam)
    for _ in range(steps):  # on m scalars; q = (singular value of the k-th iterate)^2
        q = h * h * lam
        h = h * (a + q * (b + c * q))
    return ((vec * h) @ vec.T) @ x


def resolve_ns_method(method: str, dtype: torch.dtype, device) -> str:
    """`auto` -> by-shape for fp32 Newton-Schulz on a CPU, iterate otherwise."""
    if method not in NS_METHODS:
        raise ValueError(f"Newton-Schulz method must be one of {', '.join(NS_METHODS)}, got {method!r}")
    if method != "auto":
        return method
    return "by-shape" if dtype == torch.float32 and torch.device(device).type == "cpu" else "iterate"


@contextlib.contextmanager
def ns_precision(dtype: torch.dtype | None, method: str = "iterate"):
    """Inside the block, torch.optim.Muon runs its Newton-Schulz step in `dtype` (None: torch's bf16),
    evaluated by `method` (iterate, spectral or by-shape; see the module docstring).

    The Muon update stays torch.optim.Muon's own; only how its Newton-Schulz polynomial is evaluated is
    chosen here.
    """
    original = getattr(_muon_impl, "_zeropower_via_newtonschulz", None)
    torchs_own = dtype in (None, torch.bfloat16) and method == "iterate"
    if torchs_own or original is None:
        if not torchs_own:
            warnings.warn("this torch version's Muon offers no Newton-Schulz hook; it runs in its own precision")
        yield
        return
    dt = dtype or torch.bfloat16
    _muon_impl._zeropower_via_newtonschulz = lambda g, coef, steps, eps: newton_schulz(g, coef, steps, eps, dt, method)
    try:
        yield
    finally:
        _muon_impl._zeropower_via_newtonschulz = original


def default_ns_dtype(device) -> torch.dtype:
    return torch.bfloat16 if fast_bf16(device) else torch.float32
