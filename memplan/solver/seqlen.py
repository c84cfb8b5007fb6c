"""Plan the sequence length: a plan at a length, the longest length with a plan, packed
batches in tokens (docs/design.md, "Sequence length"). No torch here.

A plan at ``S`` tokens is the ordinary solve on ``memplan.profile.seqlen.profile_at(profile, S)``.
Peaks do not shrink as the length grows (every accepted fit has non-negative
coefficients), so the longest length that has a plan is found by doubling, then bisection,
over the steps (multiples of ``--seq-multiple``). Each answer also names the first step
beyond it that has no plan, and what that step needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memplan.errors import NoPlanFitsError
from memplan.profile import Profile
from memplan.profile.seqlen import (
    DEFAULT_SEQ_MULTIPLE,
    MAX_SEQ_LEN,
    SeqLenError,
    SeqModel,
    check_seq_len,
    require_grid,
)
from memplan.solver.batches import SplitError
from memplan.units import format_bytes

if TYPE_CHECKING:
    from memplan.solver import SolveRequest, SolveResult


@dataclass(frozen=True, kw_only=True, slots=True)
class SeqSolve:
    """A plan at a sequence length, and the length after the longest one that fits."""

    result: SolveResult
    """The solve at ``seq_len``; its plan records ``seq_len``."""
    seq_len: int
    longest: int | None
    """The longest length, in steps of ``multiple``, with a plan at this batch and budget;
    None when no step fits (``--seq-len N`` below the first step) or none was searched."""
    next_len: int | None
    """``longest + multiple``: the first step that has no plan (None: the search reached
    ``MAX_SEQ_LEN``)."""
    next_least_peak_bytes: int | None
    """What the least plan at ``next_len`` needs."""
    multiple: int


def solve_seq(
    profile: Profile,
    request: SolveRequest,
    seq_len: int | None,
    *,
    multiple: int = DEFAULT_SEQ_MULTIPLE,
    tokens_per_batch: int | None = None,
) -> SeqSolve:
    """Plan at ``seq_len`` tokens per sample, or (None) at the longest multiple of
    ``multiple`` that has a plan. With ``tokens_per_batch`` the effective batch is that many
    tokens: ``target_batch = tokens_per_batch / seq_len`` (only lengths that divide it are
    steps). Either way the result names the first step beyond the plan's length that has no
    plan, and what it needs. Raises NoPlanFitsError when nothing fits (for ``max``: with
    what the first step needs), SeqLenError for a length memplan cannot plan."""
    from memplan.solver.search import has_plan, least_peak, solve_batch

    multiple = check_seq_len(multiple, flag="--seq-multiple")
    if seq_len is not None:
        check_seq_len(seq_len)
        limit = profile.max_seq_len
        if limit is not None and seq_len > limit:
            raise SeqLenError(
                f"--seq-len {seq_len} is longer than the model takes: its config has "
                f"{limit} positions ({profile.model.spec}).",
                hint=f"Plan {limit} tokens or fewer (--seq-len max stops there too).",
            )
    if tokens_per_batch is not None and (
        isinstance(tokens_per_batch, bool)
        or not isinstance(tokens_per_batch, int)
        or tokens_per_batch < 1
    ):
        raise SeqLenError(
            f"--tokens-per-batch must be a positive number of tokens, got {tokens_per_batch!r}."
        )
    if profile.seq is None and not (seq_len is not None and seq_len == profile.seq_len):
        require_grid(profile, flag="--seq-len" if seq_len is not None else "--seq-len max")
    evaluate = (lambda s: profile) if profile.seq is None else SeqModel(profile).at
    steps = _Steps(multiple, tokens_per_batch, profile.max_seq_len)

    def fits(i: int) -> bool:
        s = steps[i]
        try:
            return has_plan(evaluate(s), _request_at(request, s, tokens_per_batch))
        except SplitError:  # too few samples of the tokens at s to split: no plan there
            return False  # (before, the search stopped with exit 2 on the user's request)

    if profile.seq is None:  # one probed length: that length only, nothing to search
        chosen, longest_i = seq_len, None
    elif seq_len is None:
        if not len(steps) or not fits(0):
            shortest = steps[0] if len(steps) else multiple
            need = least_peak(evaluate(shortest), _request_at(request, shortest, tokens_per_batch))
            raise NoPlanFitsError(
                f"No sequence length has a plan: even {shortest} tokens (the first step of "
                f"--seq-multiple {multiple}) needs {format_bytes(need.peak_bytes)} at the "
                f"least, over the budget of {format_bytes(request.budget_bytes)}.",
                hint="Raise the budget, lower --target-batch, or shard (--world-size, --strategy).",
                min_peak_bytes=need.peak_bytes,
                closest=dataclasses.replace(need.plan, seq_len=shortest),
            )
        longest_i = _last_fitting(1, len(steps), fits)
        chosen = steps[longest_i]
    else:
        chosen = seq_len
        longest_i = _last_fitting(steps.first_above(seq_len), len(steps), fits)
    assert chosen is not None
    result = solve_batch(evaluate(chosen), _request_at(request, chosen, tokens_per_batch))
    longest = chosen if longest_i is None or steps[longest_i] < chosen else steps[longest_i]
    next_i = None if longest_i is None else max(longest_i + 1, steps.first_above(chosen))
    next_len = steps[next_i] if next_i is not None and next_i < len(steps) else None
    next_peak: int | str | None = None
    if next_len is not None:
        try:
            next_peak = least_peak(
                evaluate(next_len), _request_at(request, next_len, tokens_per_batch)
            ).peak_bytes
        except SplitError as exc:  # what it cannot split, said as the reason
            next_peak = exc.message
    reasons = _seq_reasons(
        chosen,
        longest if longest_i is not None else None,
        next_len,
        next_peak,
        multiple,
        request,
        tokens_per_batch,
    )
    plan = dataclasses.replace(
        result.plan, seq_len=chosen, reasons=(*result.plan.reasons, *reasons)
    )
    return SeqSolve(
        result=dataclasses.replace(result, plan=plan),
        seq_len=chosen,
        longest=longest if longest_i is not None else None,
        next_len=next_len,
        next_least_peak_bytes=next_peak if isinstance(next_peak, int) else None,
        multiple=multiple,
    )


class _Steps:
    """The lengths ``--seq-len max`` may answer: multiples of ``multiple`` up to
    ``MAX_SEQ_LEN`` (or the model's own ``max_seq_len``), and with ``tokens`` only those that divide it. Indexed, not listed."""

    def __init__(self, multiple: int, tokens: int | None, longest: int | None = None) -> None:
        self.multiple = multiple
        self.top = min(MAX_SEQ_LEN, longest) if longest is not None else MAX_SEQ_LEN
        """The model's own limit (``Profile.max_seq_len``) where known."""
        self.listed: list[int] | None = None
        if tokens is not None:
            top = min(tokens, self.top)
            self.listed = [s for s in range(multiple, top + 1, multiple) if tokens % s == 0]

    def __len__(self) -> int:
        return len(self.listed) if self.listed is not None else self.top // self.multiple

    def __getitem__(self, i: int) -> int:
        return self.listed[i] if self.listed is not None else (i + 1) * self.multiple

    def first_above(self, length: int) -> int:
        """Index of the first step longer than ``length``."""
        if self.listed is None:
            return length // self.multiple
        return next((i for i, s in enumerate(self.listed) if s > length), len(self.listed))


def _last_fitting(start: int, count: int, fits: Callable[[int], bool]) -> int:
    """The last index in ``[start - 1, count)`` for which ``fits`` holds, given that it holds
    up to ``start - 1`` and, once false, stays false (peaks do not shrink as the length
    grows): doubling from ``start``, then bisection. ``start - 1`` when none after it fits."""
    good, span, bad = start - 1, 1, count
    while good + span < count:
        if not fits(good + span):
            bad = good + span
            break
        good += span
        span *= 2
    lo, hi = good + 1, bad
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            good, lo = mid, mid + 1
        else:
            hi = mid
    return good


def _request_at(request: SolveRequest, seq_len: int, tokens_per_batch: int | None) -> SolveRequest:
    """The request at one length: a target batch in samples (``tokens_per_batch`` over the
    length), no length left to search."""
    if tokens_per_batch is None:
        if request.seq_len is None and request.tokens_per_batch is None:
            return request
        return dataclasses.replace(request, seq_len=None, tokens_per_batch=None)
    if tokens_per_batch % seq_len:
        raise SeqLenError(
            f"--tokens-per-batch {tokens_per_batch} is not a whole number of samples of "
            f"{seq_len} tokens.",
            hint=f"Use a multiple of {seq_len}, e.g. "
            f"{max(tokens_per_batch // seq_len, 1) * seq_len}.",
        )
    return dataclasses.replace(
        request, target_batch=tokens_per_batch // seq_len, tokens_per_batch=None, seq_len=None
    )


def _seq_reasons(
    chosen: int,
    longest: int | None,
    next_len: int | None,
    next_peak: int | str | None,
    multiple: int,
    request: SolveRequest,
    tokens: int | None,
) -> list[str]:
    from memplan.memory import usable_budget_bytes

    lines = []
    if tokens is not None:
        lines.append(
            f"packed batches: {tokens} tokens per optimizer step = {tokens // chosen} samples "
            f"of {chosen} tokens"
        )
    if longest is not None and longest == chosen:
        lines.append(
            f"seq_len {chosen}: the longest length in steps of {multiple} tokens with a plan "
            "at this batch and budget"
        )
    elif longest is not None:
        lines.append(
            f"seq_len {chosen}: lengths up to {longest} (in steps of {multiple} tokens) also "
            "have a plan at this batch and budget"
        )
    if next_len is not None and isinstance(next_peak, str):
        lines.append(f"seq_len {next_len} has no plan: {next_peak}")
    elif next_len is not None and next_peak is not None:
        lines.append(
            f"seq_len {next_len} has no plan: it needs {format_bytes(next_peak)} at the least, "
            f"over the {format_bytes(usable_budget_bytes(request.budget_bytes, request.margin))} "
            "usable"
        )
    return lines
