"""The one entry point of the solver: ``solve(profile, request)``. The request carries the
effective batch (samples or tokens), the sequence length and the parallel layout; this module
sends it to the search that answers it — at one batch (memplan.solver.search), over lengths
(memplan.solver.seqlen) or over layouts (memplan.solver.parallel) — and returns one
SolveResult. No torch.
"""

from __future__ import annotations

import dataclasses

from memplan import memory
from memplan.errors import BadInputError
from memplan.profile import Profile
from memplan.solver.request import SolveRequest, SolveResult
from memplan.solver.search import solve_batch


def solve(profile: Profile, request: SolveRequest) -> SolveResult:
    """The plan for ``request`` on ``profile``: with a layout, the fastest layout that fits
    (``result.layouts`` lists every one); with a length or a batch in tokens, the plan at
    that length or the longest that fits (``result.seq``); else the plan at the target
    batch. Raises BadInputError for a request the profile cannot answer (exit 2) and
    NoPlanFitsError when no plan fits (exit 1)."""
    if request.layout is not None:
        from memplan.solver.parallel import solve_layout

        laid = solve_layout(profile, dataclasses.replace(request, layout=None), request.layout)
        return SolveResult(
            plan=laid.plan,
            candidates=(),
            usable_budget_bytes=memory.usable_budget_bytes(request.budget_bytes, request.margin),
            reserve=memory.reserve_for(profile, request.device_spec),
            timing_source=laid.options[0].stages[0].timing_source if laid.options else "",
            layouts=laid.options,
        )
    if request.seq_len is None and request.tokens_per_batch is None:
        return solve_batch(profile, request)
    from memplan.solver.seqlen import solve_seq

    length = None if request.seq_len == "max" else request.seq_len
    if request.tokens_per_batch is not None and request.seq_len is None:
        if profile.seq_len is None:
            raise BadInputError(
                "--tokens-per-batch needs the length of a sample: give --seq-len N or max."
            )
        length = profile.seq_len
    seq = solve_seq(
        profile,
        request,
        length,
        multiple=request.seq_multiple,
        tokens_per_batch=request.tokens_per_batch,
    )
    return dataclasses.replace(seq.result, seq=seq)
