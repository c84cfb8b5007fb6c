"""Where ``memplan solve`` writes: the plan YAML (``-o``) and one file per ``--format``.

Every target is refused, if it must be, before anything is solved (an unknown format, an
existing file without ``--force``, something that is not a regular file, an unwritable
folder, two outputs on one file); after solving, every format that can write the plan is
written, and the formats that cannot are returned with why, so that one refusal does not
stop the others.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memplan.emit import FORMATS, emit_all
from memplan.errors import BadInputError, MemplanError
from memplan.files.io import check_outputs, write_outputs
from memplan.model.reference import relative_reference
from memplan.plan import Plan, plan_to_yaml


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanTargets:
    """The files a solve will write, already checked."""

    folder: Path
    """Where the ``--format`` files go; scripts resolve a relative model path against it."""
    targets: tuple[tuple[Path, str | None], ...]
    """``(path, format)``; format None is the plan YAML named by ``-o``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WrittenFiles:
    """What ``write_plan_files`` wrote, and the formats that cannot write the plan."""

    paths: tuple[Path, ...]
    refused: tuple[tuple[str, MemplanError], ...]
    notes: tuple[tuple[Path, str], ...] = ()
    """(file written, note): what a file without comments cannot say (``Format.notes``)."""


def plan_targets(
    output: Path | None,
    formats: str | None,
    out_dir: Path | None,
    *,
    force: bool,
    inputs: Sequence[str | os.PathLike[str]] = (),
) -> PlanTargets:
    """The checked targets of ``-o output --format a,b --out-dir DIR``: the ``--format`` files
    go to ``out_dir``, else beside ``output``, else the current folder. Raises BadInputError
    (or OutputExistsError) for any target that would be refused at write time, or that is
    one of ``inputs`` (the profiles solve reads)."""
    wanted = [f.strip() for f in (formats or "").split(",") if f.strip()]
    if formats is not None and not wanted:
        raise BadInputError(
            f"--format {formats!r} names no format; memplan would write nothing for it.",
            hint=f"Name one or more, comma-separated: {', '.join(FORMATS)}; or leave --format out.",
        )
    unknown = [f for f in wanted if f not in FORMATS]
    if unknown:
        raise BadInputError(
            f"--format {', '.join(unknown)} is not a known format.",
            hint=f"Known formats: {', '.join(FORMATS)}.",
        )
    folder = out_dir or (output.parent if output is not None else Path("."))
    targets: list[tuple[Path, str | None]] = [] if output is None else [(output, None)]
    targets += [
        (folder / FORMATS[fmt].filename, fmt)
        for fmt in wanted
        if not (fmt == "plan" and output is not None)
    ]
    check_outputs(
        [path for path, _ in targets],
        force=force,
        # a --format file's path is --out-dir's (or -o's folder): -o names only the plan YAML
        options=["-o" if fmt is None else "--out-dir" for _, fmt in targets],
        inputs=inputs,
    )
    return PlanTargets(folder=folder, targets=tuple(targets))


def write_plan_files(plan: Plan, targets: PlanTargets, *, force: bool) -> WrittenFiles:
    """Write ``plan`` to every target whose format can write its strategy (scripts name the
    model relative to their own folder); the others come back in ``refused``. A plan that
    would not read back is exit 3 before any file is written (``plan_to_yaml``)."""
    plan_text = plan_to_yaml(plan)
    emitted = emit_all(
        plan,
        [fmt for _, fmt in targets.targets if fmt is not None],
        model_path=relative_reference(plan.model, targets.folder),
        folder=targets.folder,
    )
    texts = {fmt: text for fmt, _, text in emitted.files}
    outputs = [
        (path, plan_text if fmt is None else texts[fmt])
        for path, fmt in targets.targets
        if fmt is None or fmt in texts
    ]
    paths = write_outputs(outputs, force=force)
    where = {fmt: path for path, fmt in targets.targets}
    notes = tuple((where[fmt], note) for fmt, note in emitted.notes)
    return WrittenFiles(paths=tuple(paths), refused=tuple(emitted.refused), notes=notes)
