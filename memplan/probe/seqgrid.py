"""Probe a model at several sequence lengths (``memplan probe --seq-lens``; issue 13).

Each length is an ordinary probe over the micro-batch sizes, with ``make_batch(batch_size,
seq_len)`` bound to that length and every timeline point kept in op order, so that point i
of a segment is the same op at every length. ``memplan.profile.seqlen.grid_profile`` then fits
each quantity across lengths and prunes the points together (docs/design.md, "Sequence
length").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from memplan.errors import BadInputError, checkpointing_failure
from memplan.model.loader import ModelFile, load_model_file
from memplan.probe.runner import Progress, probe_sizes
from memplan.probe.settings import TIMING_ROUNDS, ProbeSettings
from memplan.profile import Profile
from memplan.profile.seqlen import grid_profile


def probe_seq_grid(
    model_file_path: str | ModelFile,
    seq_lens: Sequence[int],
    *,
    device: str = "auto",
    micro_batches: Sequence[int] = (1, 2, 4),
    precision: str = "fp32",
    layers: str | None = None,
    device_profile: str | None = None,
    on_progress: Progress | None = None,
    mixed_precision: str = "autocast",
    reuse_identical: bool = True,
    float8_recipe: str = "tensorwise",
    float8_all_gather: bool = True,
    compiled: bool = False,
    timing_rounds: int = TIMING_ROUNDS,
) -> Profile:
    """The profile of ``model_file_path`` over ``seq_lens`` × ``micro_batches``: one
    length gives an ordinary profile at that length (``Profile.seq_len``), two or more a
    grid (``Profile.seq``)."""
    lens = sorted(set(int(s) for s in seq_lens))
    sizes = sorted(set(int(b) for b in micro_batches))
    if len(sizes) < 2 or sizes[0] < 1:
        raise BadInputError(
            f"micro_batches {tuple(micro_batches)} must hold at least two distinct positive sizes.",
            hint="For example 1,2,4: affine fits need two sizes; three give a residual.",
        )
    model_file = (
        model_file_path
        if isinstance(model_file_path, ModelFile)
        else load_model_file(model_file_path)
    )
    bound = [model_file.at_seq_len(s) for s in lens]  # exit 2 before any probing
    settings = ProbeSettings(
        device=device,
        micro_batches=tuple(sizes),
        precision=precision,
        layers=layers,
        device_profile=device_profile,
        mixed_precision=mixed_precision,
        reuse_identical=reuse_identical,
        float8_recipe=float8_recipe,
        float8_all_gather=float8_all_gather,
        compiled=compiled,
        timing_rounds=timing_rounds,
    )
    per_length = 2 + (7 + (device != "meta")) * len(sizes) + 2
    total = per_length * len(lens)
    done = 0

    def ticker(s: int) -> Callable[[str], None]:
        def tick(what: str) -> None:
            nonlocal done
            done += 1
            if on_progress is not None:
                on_progress(min(done, total), total, f"s={s}: {what}")

        return tick

    profiles = []
    for s, mf in zip(lens, bound, strict=True):
        try:
            profile = probe_sizes(mf, settings, ticker(s), prune=len(lens) == 1)
        except Exception as exc:
            known = checkpointing_failure(exc, mf.spec)
            if known is None:
                raise
            raise known from exc
        profiles.append(dataclasses.replace(profile, seq_len=s))
    if len(lens) == 1:
        return profiles[0]
    return grid_profile(lens, profiles)
