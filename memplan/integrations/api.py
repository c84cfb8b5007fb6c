"""Plan a live model from inside a training script: ``plan_model`` (issue 32).

The model a script holds (or a factory, which lets a model be planned on meta without ever
being built with data) is handed to the probe as an in-memory model file
(``memplan.model.loader.ModelFile``): ``build_model`` returns a copy of the model made for the
planning (on meta, parameters and buffers are copied as meta tensors, without their data),
``make_batch(n)`` calls the batch function or takes ``n`` samples of the batch given
(cycling), ``training_loss`` is the loss function and ``make_optimizer`` rebuilds the
user's optimizer (its class and parameter groups) over the copy. The profile is then solved
as ``memplan solve`` solves it, and written in any of its formats.

Planning leaves the live model (parameters, buffers, gradients, ``training`` flags), the
optimizer and the RNG states (torch CPU and CUDA, ``random``, numpy) as they were: the probe
only ever touches the copy, and the RNG states are restored afterwards. A loss function or
batch function that reaches past its arguments to the live model is caught: the live
parameters' versions and gradients are compared before and after.
"""

from __future__ import annotations

import inspect
import itertools
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memplan.errors import BadInputError
from memplan.integrations.live import live_model_file, rng_preserved, unchanged
from memplan.integrations.terms import in_script
from memplan.memory import DEFAULT_MARGIN
from memplan.plan import Plan
from memplan.probe.settings import TIMING_ROUNDS
from memplan.profile import Profile
from memplan.suggest import did_you_mean
from memplan.units import parse_size

__all__ = [
    "budget_bytes",
    "check_options",
    "plan_model",
    "profile_model",
    "resolve_device",
    "solve_profile",
]

Budget = str | int | float
DEVICES = ("auto", "cpu", "cuda", "meta")


# ------------------------------------------------------------------------------ public
@in_script(lambda: request_parameters())
def plan_model(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    batch: Any,
    *,
    budget: Budget,
    target_batch: int | None = None,
    loss_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
    optimizer: torch.optim.Optimizer | Callable[[torch.nn.Module], Any] | None = None,
    device: str | None = None,
    precision: str = "fp32",
    mixed_precision: str = "autocast",
    micro_batches: Sequence[int] = (1, 2, 4),
    layers: str | None = None,
    device_profile: str | None = None,
    seq_lens: Sequence[int] = (),
    timing_rounds: int = TIMING_ROUNDS,
    compiled: bool = False,
    keep: Sequence[Any] = (),
    prepare: Callable[[torch.nn.Module], None] | None = None,
    **request: Any,
) -> Plan:
    """The plan for training ``model`` on batches like ``batch`` within ``budget``.

    ``model``: an ``nn.Module`` (planned from a copy, on the device it is on unless
    ``device`` says otherwise) or a factory returning one (``device="meta"`` builds it on
    meta). ``batch``: a batch (a tensor, tuple/list or dict of tensors, samples along the
    first dimension) or a function ``batch_fn(batch_size)`` (or ``(batch_size, seq_len)``)
    returning one. ``loss_fn(model, batch)`` returns the scalar loss (default: the model's
    output, or its ``.loss``). ``optimizer``: the optimizer the script trains with (its
    class and parameter groups are rebuilt over the copy) or a function ``f(model)``
    returning one; default AdamW. ``precision``, ``micro_batches``, ``layers``,
    ``seq_lens`` and ``timing_rounds`` are ``memplan probe``'s options (a meta probe runs no
    timing rounds), and ``compiled`` is its ``--compiled``: with ``device="meta"``, the
    step timed as ``torch.compile`` runs it, and the plan marked compiled.

    The request is ``memplan solve``'s (``solve_profile``): ``target_batch`` (samples) or
    ``tokens_per_batch`` (with ``seq_len``), ``budget`` (``"24GiB"``, bytes, ``"80%"`` of
    the device, or ``"auto"``: the free memory of the GPU, or on the CPU the host's
    available memory), ``world_size``, ``strategy``, ``modes``, ``margin`` and the rest;
    ``output`` and ``formats`` write its files. ``keep`` and ``prepare`` are for the
    integrations (``memplan.integrations.live.live_model_file``). Every option is checked
    before the probe runs; NoPlanFitsError when nothing fits, before any training."""
    check_options("plan_model", request, solve_only=True)
    probe_device = resolve_device(model, device)
    # the spec also sizes a percentage budget: "80%" with device_profile= was refused as "no
    # device is known" (the spec went to the probe alone)
    ask = _ask(
        probe_device,
        budget=budget,
        target_batch=target_batch,
        device_profile=device_profile,
        **request,
    )
    profile = profile_model(
        model,
        batch,
        loss_fn=loss_fn,
        optimizer=optimizer,
        device=probe_device,
        precision=precision,
        mixed_precision=mixed_precision,
        micro_batches=micro_batches,
        layers=layers,
        device_profile=ask.device_profile,
        seq_lens=tuple(seq_lens) or ((ask.length,) if ask.length is not None else ()),
        timing_rounds=timing_rounds,
        compiled=compiled,
        where=_caller_file(),
        keep=keep,
        prepare=prepare,
    )
    return ask.finish(profile)


@in_script(lambda: request_parameters())
def solve_profile(
    profile: Profile, *, budget: Budget, target_batch: int | None = None, **request: Any
) -> Plan:
    """``memplan solve`` for a Profile held in memory: the same request (see ``_ask``), the
    same solvers, the same files written."""
    check_options("solve_profile", request, solve_only=True)
    return _ask(profile.device, budget=budget, target_batch=target_batch, **request).finish(profile)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Ask:
    """A checked request, ready to solve a profile and write the files asked for."""

    request: Any
    """The ``memplan.solver.SolveRequest``: batch, length and layout included."""
    targets: Any
    force: bool
    device_profile: str | None

    @property
    def length(self) -> int | None:
        """The sequence length asked for (None: none, or ``max``)."""
        seq_len = self.request.seq_len
        return seq_len if isinstance(seq_len, int) else None

    def finish(self, profile: Profile) -> Plan:
        from memplan.emit.files import write_plan_files
        from memplan.solver import solve

        plan = solve(profile, self.request).plan  # the one entry point, as `memplan solve`
        if self.targets is not None:
            written = write_plan_files(plan, self.targets, force=self.force)
            if written.refused:
                raise written.refused[-1][1]
        return plan


def _ask(
    device: str,
    *,
    budget: Budget,
    target_batch: int | None = None,
    tokens_per_batch: int | None = None,
    seq_len: int | str | None = None,
    seq_multiple: int = 64,
    world_size: int = 1,
    strategy: str = "ddp",
    modes: str | Sequence[str] | None = None,
    margin: float = DEFAULT_MARGIN,
    min_micro: int = 1,
    max_micro: int | None = None,
    always_checkpoint: Sequence[str] = (),
    never_checkpoint: Sequence[str] = (),
    bn_min_micro: int = 16,
    allow_small_bn_micro: bool = False,
    device_profile: str | None = None,
    host_memory: str | int | None = None,
    layout: Any = None,
    model_ref: str | None = None,
    output: str | Path | None = None,
    formats: str | Sequence[str] | None = None,
    out_dir: str | Path | None = None,
    force: bool = False,
) -> _Ask:
    """The request of ``memplan solve``, checked: its options as the command's (``layout``
    a ``memplan.solver.parallel.LayoutRequest``; ``model_ref`` the model file the plan and its
    scripts name; ``output``/``formats``/``out_dir``/``force`` as ``-o``/``--format``/
    ``--out-dir``/``--force``)."""
    from memplan.emit.files import plan_targets
    from memplan.solver import SolveRequest

    targets = None
    if output is not None or formats:
        # (an empty list: no formats, as None; --format's empty text is refused)
        wanted = formats if isinstance(formats, str | None) else ",".join(formats) or None
        targets = plan_targets(
            Path(output) if output is not None else None,
            wanted,
            Path(out_dir) if out_dir is not None else None,
            force=force,
        )
    spec = _device_spec(device_profile)
    request = SolveRequest(
        target_batch=target_batch,
        tokens_per_batch=tokens_per_batch,
        seq_len=_seq_length(seq_len),
        seq_multiple=seq_multiple,
        layout=layout,
        budget_bytes=budget_bytes(budget, device, spec),
        world_size=world_size,
        strategy=strategy,
        margin=margin,
        min_micro=min_micro,
        max_micro=max_micro,
        always_checkpoint=_names(always_checkpoint),
        never_checkpoint=_names(never_checkpoint),
        bn_min_micro=bn_min_micro,
        allow_small_bn_micro=allow_small_bn_micro,
        device_spec=spec,
        model_path=model_ref,
        modes=modes if modes is None or isinstance(modes, str) else ",".join(modes),
        host_memory_bytes=_host_memory(host_memory),
    )
    return _Ask(request=request, targets=targets, force=force, device_profile=device_profile)


@in_script(lambda: request_parameters())
def profile_model(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    batch: Any,
    *,
    loss_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
    optimizer: Any = None,
    device: str | None = None,
    precision: str = "fp32",
    mixed_precision: str = "autocast",
    micro_batches: Sequence[int] = (1, 2, 4),
    layers: str | None = None,
    device_profile: str | None = None,
    seq_lens: Sequence[int] = (),
    timing_rounds: int = TIMING_ROUNDS,
    compiled: bool = False,
    where: Path | None = None,
    keep: Sequence[Any] = (),
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> Profile:
    """The profile ``memplan probe`` would write for the live model (see ``plan_model``),
    measured on a copy; the model, the optimizer and the RNG states are left as they were."""
    from memplan.probe import probe_model
    from memplan.probe.seqgrid import probe_seq_grid

    probe_device = resolve_device(model, device)
    if isinstance(micro_batches, int | str) or not isinstance(micro_batches, Sequence):
        raise BadInputError(
            f"micro_batches must be the batch sizes to probe, such as (1, 2, 4); got "
            f"{micro_batches!r}.",
            hint=f"Pass micro_batches=({micro_batches!r},) for one size."
            if isinstance(micro_batches, int)
            else None,
        )
    if compiled and probe_device != "meta":
        raise BadInputError(
            f"compiled=True times the step as torch.compile's fused kernels move bytes, on "
            f"the meta clock; a probe on {probe_device} times the eager ops it runs.",
            hint="Plan with device='meta' (and device_profile= for the GPU), or drop compiled.",
        )
    model_file = live_model_file(
        model,
        batch,
        loss_fn=loss_fn,
        optimizer=optimizer,
        device=probe_device,
        where=where or _caller_file(),
        keep=keep,
        prepare=prepare,
    )
    live = model if isinstance(model, torch.nn.Module) else None
    if not compiled and isinstance(getattr(live, "_orig_mod", None), torch.nn.Module):
        warnings.warn(
            f"memplan: the model is compiled (torch.compile); the probe on {probe_device} runs "
            "the module inside it eagerly, so the plan's bytes and step time are eager's "
            "(compiled=True with device='meta' times the step as torch.compile runs it).",
            UserWarning,
            stacklevel=2,
        )
    how = {
        "device": probe_device,
        "micro_batches": micro_batches,
        "precision": precision,
        "layers": layers,
        "device_profile": device_profile,
        "mixed_precision": mixed_precision,
        "timing_rounds": timing_rounds,
        "compiled": compiled,
    }
    with rng_preserved(cuda=probe_device != "cpu"), unchanged(live):
        if seq_lens:
            profile = probe_seq_grid(model_file, seq_lens, **how)
        else:
            profile = probe_model(model_file, **how)
    # what `memplan probe` prints as warnings (a NaN loss, BatchNorm's statistics), said in
    # the script as Python warnings; before, plan_model said nothing of them
    for text in profile.warnings:
        warnings.warn(f"memplan: {text}", UserWarning, stacklevel=2)
    return profile


def request_parameters() -> dict[str, inspect.Parameter]:
    """The keyword arguments of ``memplan solve``'s request that the entry points forward
    (``**request``), by name."""
    return {n: p for n, p in inspect.signature(_ask).parameters.items() if n != "device"}


def resolve_device(model: Any, device: str | None) -> str:
    """Where the probe runs: ``device``, else where the live model is (a factory: auto)."""
    if device is not None and device not in DEVICES:
        raise BadInputError(f"device {device!r} is not one of {', '.join(DEVICES)}.")
    if not isinstance(model, torch.nn.Module):
        return device or "auto"
    kinds = {t.device.type for t in itertools.chain(model.parameters(), model.buffers())}
    here = "meta" if "meta" in kinds else ("cuda" if "cuda" in kinds else "cpu")
    if device in (None, "auto"):
        return here
    if here == "meta" and device != "meta":
        raise BadInputError(
            f"The model is on meta (shapes without data), so it cannot run on {device}.",
            hint="Plan it with device='meta', or pass the function that builds the model "
            "instead of the model.",
        )
    return device


def check_options(owner: str, options: dict[str, Any], *, solve_only: bool = False) -> None:
    """Refuse a keyword ``owner`` passes on that no one takes, before anything runs:
    Python's own TypeError would name memplan's internal ``_ask``, and from a callback's
    constructor it would come only when the fit starts. ``solve_only``: ``options`` go to
    the request of ``memplan solve`` alone (else to ``plan_model``, which also takes the
    probe's)."""
    known = {name for name in inspect.signature(_ask).parameters if name != "device"}
    if not solve_only:
        # (``keep`` and ``prepare`` are the integrations' own: they pass them themselves)
        skip = {"model", "batch", "request", "keep", "prepare"}
        known |= set(inspect.signature(plan_model).parameters) - skip
    for name in options:
        if name not in known:
            hint = did_you_mean(name, sorted(known), n=1, quote=True)
            raise TypeError(
                f"{owner}() got an unexpected keyword argument {name!r}"
                + (f" ({hint[0].lower()}{hint[1:-1]}?)" if hint else "")
                + f"; it takes {', '.join(sorted(known))}."
            )


def budget_bytes(budget: Budget, device: str, spec: Any = None) -> int:
    """``budget`` in bytes: a positive whole number of bytes, or a string as ``--budget``
    takes it; ``auto`` on the CPU is the host's available memory."""
    from memplan.devices import host_available_bytes, local_gpu, resolve_budget

    if isinstance(budget, bool) or not isinstance(budget, str | int | float):
        raise BadInputError(
            f"budget must be a size such as '24GiB', a number of bytes, a percentage or "
            f"'auto'; got {budget!r}."
        )
    if isinstance(budget, int | float) and not isinstance(budget, str):
        if not math.isfinite(budget) or budget < 1 or budget != int(budget):
            raise BadInputError(f"budget must be a positive whole number of bytes, got {budget!r}.")
        return parse_size(int(budget), what="budget")  # at most 2**62, as a plan holds
    if budget.strip().lower() == "auto" and device == "cpu":
        free = host_available_bytes()
        if free is None:
            raise BadInputError(
                "budget 'auto' on the CPU: this system does not say its free memory."
            )
        return free
    capacity = None
    if device == "cuda" and torch.cuda.is_available():
        gpu = local_gpu(torch.cuda.current_device())
        capacity = gpu.total_bytes if gpu else None
    return resolve_budget(budget, device_spec=spec, probed_capacity_bytes=capacity, what="budget")


def _names(names: str | Sequence[str]) -> tuple[str, ...]:
    """Layer names or patterns: one given as a string is one name (``memplan.apply`` takes
    it so), not its characters."""
    return (names,) if isinstance(names, str) else tuple(names)


def _device_spec(name: str | None) -> Any:
    from memplan.devices import load_device

    return load_device(name) if name else None


def _host_memory(value: str | int | None) -> int | None:
    """``host_memory`` in bytes, named as the argument: ints too go through ``parse_size``
    (not negative, at most 2**62), as ``budget`` does."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return parse_size(value, what="host_memory")
    return parse_size(str(value), what="host_memory")


def _seq_length(seq_len: int | str | None) -> int | str | None:
    """``seq_len`` as a SolveRequest takes it: tokens, or ``"max"``."""
    from memplan.profile.seqlen import parse_seq_len

    if seq_len is None:
        return None
    return parse_seq_len(str(seq_len), flag="seq_len") or "max"


def _caller_file() -> Path:
    """The first file on the stack of the user's own code (outside memplan, installed
    packages and the standard library): the user's script. From a Lightning hook it was
    Lightning's trainer/call.py, which messages then named as the file to fix."""
    from memplan.model.loader import users_file

    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<") and users_file(name):
            return Path(name)
        frame = frame.f_back
    return Path("<script>")
