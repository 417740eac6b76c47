"""The sampler: one loop over a time grid with a swappable step (ode, sde, vc, or a flow map's jumps), the last
step plain Euler (flow.euler_step), then the decode pass that reads the final state out as tokens; the settings
one call samples with (`SamplingSettings`) and a model's generation defaults (`GenerationDefaults`), each
checked once before the loop.

A step maps (denoise, z, t, t_next, x_prev) -> (z_next, x); denoise(z, t, x_prev) -> (x, v) is the network with
everything else bound (omega, guidance, known positions). The velocity is v = (x - z) / max(1 - t, t_eps).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from elflow.flow import (
    DEFAULT_GRID,
    GRIDS,
    MAX_MAP_STEPS,
    SAMPLERS,
    SAMPLING_DEFAULTS,
    SAMPLING_RANGES,
    TEXT_SAMPLING,
    Recipe,
    euler_step,
    time_grid,
)
from elflow.util.devices import AUTOCAST_DTYPES
from elflow.util.errors import ELFError, Record, check_seed


def ode_step(denoise, z, t, t_next, x_prev):
    """Euler: z' = z + (t' - t) v(z, t)."""
    x, v = denoise(z, t, x_prev)
    return euler_step(z, t, t_next, v=v), x


def map_step(denoise, z, t, t_next, x_prev):
    """A flow map's jump X(z, t, t'): the Euler step with the guess x_hat the map gives for the target t'
    (elflow.flowmap); at t' = 1 it lands on x_hat, as the last Euler step does."""
    x, v = denoise(z, t, x_prev, t_next)
    return euler_step(z, t, t_next, v=v), x


def sde_step(denoise, z, t, t_next, x_prev, *, gamma, noise, generator, noise_scale, pin, consistent=False):
    """Back off to t_b = alpha t, alpha = clip(1 - gamma (t' - t), 0, 1), re-noise z_b = alpha z + std e, then
    Euler from t_b to t'. The released step has std = (1 - alpha) noise_scale; the variance-consistent one
    (consistent=True) has std = noise_scale sqrt((1 - t_b)^2 - alpha^2 (1 - t)^2), so that z_b carries exactly
    the path's noise level at t_b. `pin` puts known positions back after the re-noising."""
    alpha = (1 - gamma * (t_next - t)).clamp(0, 1)
    t_b = alpha * t
    if consistent:
        std = noise_scale * ((1 - t_b) ** 2 - (alpha * (1 - t)) ** 2).clamp_min(0).sqrt()
    else:
        std = (1 - alpha) * noise_scale
    noise.normal_(generator=generator)  # one N(0, 1) draw of z's shape per step, into a buffer made once
    z_b = pin(alpha * z + std * noise)
    x, v = denoise(z_b, t_b, x_prev)
    return euler_step(z_b, t_b, t_next, v=v), x


def check_sampling_args(steps: int, gamma: float, omega: float, guidance: float = 1.0, sampler: str = "sde",
                        recipe: Recipe = Recipe()) -> None:
    """ValueError for settings no sampler can use (SAMPLING_RANGES); a warning for an omega outside the range
    the model trained on."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if sampler == "map" and isinstance(steps, int) and not 1 <= steps <= MAX_MAP_STEPS:
        raise ValueError(f"a flow map samples with 1 to {MAX_MAP_STEPS} steps (its jumps), got {steps!r}")
    for name, value in (("steps", steps), ("gamma", gamma), ("guidance", guidance), ("omega", omega)):
        ok, what = SAMPLING_RANGES[name]
        if not ok(value):
            raise ValueError(f"{name} must be {what}, got {value!r}")
    if not recipe.omega_low <= omega <= recipe.omega_high:
        warnings.warn(f"omega {omega} lies outside the range the model was trained on "
                      f"[{recipe.omega_low}, {recipe.omega_high}]; results may be poor", stacklevel=2)


# a model's generation defaults (its record's "sampling"), and the settings one call samples with
@dataclass(frozen=True)
class GenerationDefaults(Record):
    """A model's generation defaults, as its record stores them: the step count, the step kind and its back-off
    gamma, the self-conditioning guidance omega, the source guidance (conditional models) and the time grid's
    kind. The path's constants (noise scale, t_eps) and the logit-normal grid's distribution are the model's
    own, its recipe's (elflow.flow.Recipe); the seed, the batch size and the precision are the caller's
    (`SamplingSettings`)."""

    steps: int = SAMPLING_DEFAULTS["text"]["steps"]
    sampler: str = SAMPLING_DEFAULTS["text"]["sampler"]
    gamma: float = SAMPLING_DEFAULTS["text"]["gamma"]
    omega: float = SAMPLING_DEFAULTS["text"]["omega"]
    guidance: float = SAMPLING_DEFAULTS["text"]["guidance"]
    grid: str = DEFAULT_GRID

    def check(self, recipe: Recipe | None = None):
        """These settings if every one is usable (ELFError naming the first that is not); a warning for an
        omega outside the range `recipe` trained on."""
        try:
            check_sampling_args(self.steps, self.gamma, self.omega, self.guidance, self.sampler,
                                recipe or Recipe())
        except ValueError as e:
            raise ELFError(str(e)) from None
        if self.grid not in GRIDS:
            raise ELFError(f"grid must be one of {', '.join(GRIDS)}, got {self.grid!r}")
        return self


@dataclass(frozen=True)
class SamplingSettings(GenerationDefaults):
    """How one call samples: a model's generation defaults (or others given), the seed, the batch size and the
    autocast precision."""

    seed: int = 0
    batch_size: int = 8
    dtype: str = "fp32"

    def check(self, recipe: Recipe | None = None) -> "SamplingSettings":
        super().check(recipe)
        ok, what = SAMPLING_RANGES["batch_size"]
        if not ok(self.batch_size):
            raise ELFError(f"the batch size must be {what}, got {self.batch_size!r}")
        check_seed(self.seed)
        if self.dtype not in AUTOCAST_DTYPES:
            raise ELFError(f"dtype must be one of {', '.join(AUTOCAST_DTYPES)}, got {self.dtype!r}")
        return self

    def tag(self) -> str:
        """A file-name tag of the settings that tell sample sets apart."""
        return (f"{self.sampler}_steps{self.steps}_omega{self.omega:g}"
                + (f"_gamma{self.gamma:g}" if self.sampler != "ode" else ""))

    def describe(self) -> str:
        return f"{self.sampler}, {self.steps} steps, omega {self.omega:g}"


def _net_device(net):
    """The device of a network's parameters; None for a plain function."""
    params = net.parameters() if isinstance(net, torch.nn.Module) else iter(())
    p = next(params, None)
    return p.device if p is not None else None


def _check_tensor(x, name: str, ndim: int, device=None, who: str = "integrate") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ELFError(f"{who}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "meta":
        raise ELFError(f"{who}: {name} is on the meta device, which holds no values; make it on cpu or cuda")
    if device is not None and x.device != device:
        raise ELFError(f"{who}: {name} is on {x.device}, the network on {device}; move it there")
    if x.ndim != ndim or x.numel() == 0:
        raise ELFError(f"{who}: {name} must be a non-empty {ndim}-D tensor, got shape {tuple(x.shape)}")
    return x


def check_network_dtype(net, who: str) -> None:
    """A network's floating-point weights are float32: elflow samples fp32 weights (bf16 runs through autocast,
    settings.dtype / --dtype bf16); a network converted with .half(), .bfloat16() or .double() is one ELFError."""
    p = next((p for p in net.parameters() if p.is_floating_point()), None) if isinstance(net, torch.nn.Module) \
        else None
    if p is not None and p.dtype != torch.float32:
        raise ELFError(f"{who}: the network's weights are {str(p.dtype).removeprefix('torch.')}; elflow samples "
                       "float32 weights (for bf16, sample with dtype bf16, which autocasts): convert it with "
                       "net.float()")


def check_omega(omega, rows: int, device, who: str) -> None:
    """The self-conditioning guidance scale a sampler or the readout takes: a number within
    SAMPLING_RANGES["omega"], or a (rows,) tensor on `device` whose every value is; ELFError naming `who`."""
    ok, what = SAMPLING_RANGES["omega"]
    if not isinstance(omega, torch.Tensor):
        if not ok(omega):
            raise ELFError(f"{who}: omega must be {what}, got {omega!r}")
        return
    _check_tensor(omega, "omega", 1, device, who)
    values = omega.detach().to("cpu", torch.float64)
    if omega.shape[0] != rows or not bool(torch.isfinite(values).all()) or not ok(float(values.min())) or \
            not ok(float(values.max())):
        raise ELFError(f"{who}: an omega tensor must hold {rows} values (one per row), each {what}, got shape "
                       f"{tuple(omega.shape)} and values from {float(values.min()):g} to {float(values.max()):g}")


def check_integrate_args(net, z0, grid, sampler, gamma, omega, guidance, known, known_mask, generator=None,
                         recipe=None, callback=None) -> None:
    """`integrate`'s arguments, checked once before its loop (one host read each of z0, the grid and the known
    values, none per step): ELFError naming the first that is wrong. z0 a floating-point (B, L, C) tensor of
    finite values on the network's device (C its width and L within its length where it has them); the grid a
    1-D tensor of at least two finite times in [0, 1], never falling; a sampler of SAMPLERS; gamma and guidance
    within SAMPLING_RANGES, omega too or a (B,) tensor; known (B, L, C) finite values with known_mask (B, L),
    both or neither; net and callback callables, generator a torch.Generator, recipe a Recipe."""
    if not callable(net):
        raise ELFError(f"integrate: net must be a network (a callable net(z, t, omega, x_prev)), got "
                       f"{type(net).__name__}")
    check_network_dtype(net, "integrate")
    for name, value, ok, what in (("generator", generator, isinstance(generator, torch.Generator), "a torch.Generator"),
                                  ("recipe", recipe, isinstance(recipe, Recipe), "a Recipe (elflow.flow.Recipe)"),
                                  ("callback", callback, callable(callback), "a callable")):
        if value is not None and not ok:
            raise ELFError(f"integrate: {name} must be None or {what}, got {type(value).__name__}")
    device = _net_device(net)
    _check_tensor(z0, "z0", 3, device)
    if not z0.is_floating_point():
        raise ELFError(f"integrate: z0 must hold floating-point values, got {z0.dtype}")
    config = getattr(net, "config", None)
    dim, length = getattr(config, "dim", None), getattr(config, "max_length", None)
    if isinstance(dim, int) and z0.shape[-1] != dim:
        raise ELFError(f"integrate: z0 has {z0.shape[-1]} channels per position, the network's space has {dim}: "
                       f"z0 must have shape (B, L, {dim})")
    if isinstance(length, int) and z0.shape[1] > length:
        raise ELFError(f"integrate: z0 has {z0.shape[1]} positions, more than the {length} the network covers")
    if sampler not in SAMPLERS:
        raise ELFError(f"integrate: unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    for name, value in (("gamma", gamma), ("guidance", guidance)):
        ok, what = SAMPLING_RANGES[name]
        if not ok(value):
            raise ELFError(f"integrate: {name} must be {what}, got {value!r}")
    check_omega(omega, z0.shape[0], z0.device, "integrate")
    _check_tensor(grid, "grid", 1)
    times = grid.detach().to("cpu", torch.float64)
    if times.numel() < 2 or not bool(torch.isfinite(times).all()) or times.min() < 0 or times.max() > 1 \
            or bool((times.diff() < 0).any()):
        raise ELFError(f"integrate: the time grid must hold at least two finite times in [0, 1], rising from the "
                       f"noise (0) to the data (1) as time_grid makes them, got {times.tolist()[:6]}")
    if (known is None) != (known_mask is None):
        raise ELFError("integrate: known and known_mask go together: pass both, or neither")
    if known is not None:
        _check_tensor(known, "known", 3)
        _check_tensor(known_mask, "known_mask", 2)
        if tuple(known.shape) != tuple(z0.shape) or tuple(known_mask.shape) != tuple(z0.shape[:2]):
            raise ELFError(f"integrate: known must have z0's shape {tuple(z0.shape)} and known_mask "
                           f"{tuple(z0.shape[:2])}, got {tuple(known.shape)} and {tuple(known_mask.shape)}")
        if not known.is_floating_point() or not bool(torch.isfinite(known).all()):
            raise ELFError("integrate: known must hold finite floating-point values")
        if known_mask.dtype != torch.bool and not bool(((known_mask == 0) | (known_mask == 1)).all()):
            raise ELFError("integrate: known_mask must be a bool tensor (True where a position is held fixed), or "
                           "hold only 0 and 1; a position is held or not, never in part")
    if not bool(torch.isfinite(z0).all()):
        raise ELFError("integrate: z0 holds NaN or infinite values; start from finite noise (noise_scale * randn)")


def integrate(net, z0: torch.Tensor, grid: torch.Tensor, *, sampler: str = TEXT_SAMPLING["sampler"],
              gamma: float = TEXT_SAMPLING["gamma"], omega=TEXT_SAMPLING["omega"], guidance: float = 1.0,
              known: torch.Tensor | None = None, known_mask: torch.Tensor | None = None,
              generator: torch.Generator | None = None, recipe: Recipe = Recipe(), callback: Callable | None = None):
    """Integrate z0 (B, L, C) over the time grid (grid[0] = 0 ... grid[-1] = 1): returns (z_final, x_last).

    net(z, t, omega, x_prev) -> x is called once per step (twice when guidance != 1 with known positions).
    Every interval but the last uses `sampler` ("ode", "sde" or "vc"); the last is a plain Euler step, which
    lands on the guess. "map" is a flow map's (a flow-map student's, the 2-D toy's): every interval one jump,
    net(z, t, omega, x_prev, target=t') (its last lands on the guess too). Each step moves z by `euler_step`.
    The previous guess fills the self-conditioning slot (zeros at the first step).

    known (B, L, C) clean embeddings and known_mask (B, L) bool mark positions held fixed (a conditional
    model's source, a prompt, a suffix): z and the guess are the clean values there and v = 0, and the first
    slot holds them. With guidance g != 1 a second pass sees z and the slot with the known positions zeroed
    (the source dropped) and v = v_u + g (v_c - v_u), x = x_u + g (x_c - x_u). Without known positions
    guidance has nothing to act on and costs no pass. `callback(i, t, z, x)` sees each step's guess.
    Every argument is checked once first (`check_integrate_args`); no host sync inside the loop; the noise
    buffer is allocated once.
    """
    check_integrate_args(net, z0, grid, sampler, gamma, omega, guidance, known, known_mask, generator, recipe,
                         callback)
    n = grid.numel() - 1
    B = z0.shape[0]
    grid = grid.to(z0.device, torch.float32)
    w = omega if isinstance(omega, torch.Tensor) else torch.full((B,), float(omega), device=z0.device)
    if known is None:
        keep = None
        def pin(a):  # noqa: E301
            return a
        x_prev = None
    else:
        keep = known_mask.to(z0.device, torch.bool)[..., None]  # (B, L, 1)
        known = known.to(z0.device, z0.dtype)
        def pin(a):  # noqa: E301
            return torch.where(keep, known, a)
        x_prev = torch.where(keep, known, torch.zeros_like(z0))
    guided = keep is not None and guidance != 1.0
    t_eps = recipe.t_eps

    def denoise(z, t, slot, target=None):
        tt = t.expand(B)
        clip = (1 - t).clamp_min(t_eps)
        at = {} if target is None else {"target": target.expand(B)}  # a flow map's jump to `target`
        x = net(z, tt, w, slot, **at)
        if keep is None:
            return x, (x - z) / clip
        v = torch.where(keep, 0.0, (x - z) / clip)
        if guided:  # the unconditional pass: the known positions dropped, its outputs zero there
            z_u, s_u = z.masked_fill(keep, 0.0), slot.masked_fill(keep, 0.0)
            x_u = net(z_u, tt, w, s_u, **at).masked_fill(keep, 0.0)
            v_u = ((x_u - z_u) / clip).masked_fill(keep, 0.0)
            v = v_u + guidance * (v - v_u)
            x = x_u + guidance * (x - x_u)
        return pin(x), v

    last = map_step if sampler == "map" else ode_step  # the last interval lands on the guess
    if sampler in ("sde", "vc"):
        step = functools.partial(sde_step, gamma=gamma, noise=torch.empty_like(z0), generator=generator,
                                 noise_scale=recipe.noise_scale, pin=pin, consistent=sampler == "vc")
    else:
        step = last
    z = pin(z0)
    for i in range(n):
        z, x_prev = (step if i < n - 1 else last)(denoise, z, grid[i], grid[i + 1], x_prev)
        if callback is not None:
            callback(i, grid[i], z, x_prev)
    return z, x_prev


def decode_tokens(net, z: torch.Tensor, omega) -> torch.Tensor:
    """The single decode pass (t = 1, zero self-conditioning slot, mode tokens on): (B, L, C) -> ids (B, L).
    omega: a number or a (B,) tensor within SAMPLING_RANGES (ELFError otherwise)."""
    _check_tensor(z, "z", 3, who="decode_tokens")
    check_omega(omega, z.shape[0], z.device, "decode_tokens")
    w = omega if isinstance(omega, torch.Tensor) else torch.full((z.shape[0],), float(omega), device=z.device)
    return net.decode(z, w).argmax(-1)


@torch.no_grad()
def generate_tokens(net, batch: int, length: int, steps: int = TEXT_SAMPLING["steps"],
                    sampler: str = TEXT_SAMPLING["sampler"], gamma: float = TEXT_SAMPLING["gamma"],
                    omega: float = TEXT_SAMPLING["omega"], grid: str = DEFAULT_GRID, guidance: float = 1.0,
                    known=None, known_mask=None, generator: torch.Generator | None = None, recipe: Recipe = Recipe(),
                    device=None, callback: Callable | None = None):
    """Draw z0 = noise_scale N(0, 1) and a fresh time grid, sample, decode: (ids (B, L), z_final (B, L, C))."""
    check_sampling_args(steps, gamma, omega, guidance, sampler, recipe)
    device = device or next(net.parameters()).device
    z0 = recipe.noise_scale * torch.randn(batch, length, net.config.dim, generator=generator, device=device)
    times = time_grid(steps, grid, generator=generator, device=device, mean=recipe.t_mean, std=recipe.t_std)
    w = torch.full((batch,), float(omega), device=device)
    z, _ = integrate(net, z0, times, sampler=sampler, gamma=gamma, omega=w, guidance=guidance, known=known,
                  known_mask=known_mask, generator=generator, recipe=recipe,
                  callback=callback)
    return decode_tokens(net, z, w), z
