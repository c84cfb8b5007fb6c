"""Baselines: a committed profile per check, compared with the new one by layer name so a
failure can say *what grew*, and rewritten by ``--update-baseline``.

A baseline is data memplan writes, so memplan only ever writes one where it is safe: inside
the config's folder tree (symlinks resolved) and over nothing but a regular file that holds
a memplan profile. A config that names a model's own source, ``../../elsewhere``, a device
node or a folder as a baseline is refused before anything is probed.
"""

from __future__ import annotations

from pathlib import Path

from memplan.check.config import ResolvedCheck, config_error
from memplan.check.result import Growth, GrowthKind, Quantity
from memplan.errors import BadInputError, MemplanError
from memplan.files.io import write_text_atomic
from memplan.model.reference import is_hf_reference, split_model_arg
from memplan.profile import FixedPart, Layer, Profile, load_profile, profile_to_yaml

# Growth smaller than this is noise (allocator rounding, timing of a meta probe), not news.
GROWTH_MIN_FRACTION = 0.01
GROWTH_MIN_BYTES = 1024


def compare_with_baseline(check: ResolvedCheck, profile: Profile) -> tuple[tuple[Growth, ...], str]:
    """(growth since the baseline, a note on why no comparison was made or what differs in
    how the baseline was probed)."""
    if check.baseline_path is None:
        return (), ""
    if not check.baseline_path.is_file():
        return (), (
            f"baseline {check.spec.baseline} does not exist yet; write it with "
            "`memplan check --update-baseline`"
        )
    try:
        baseline = load_profile(check.baseline_path)
    except MemplanError as exc:
        return (), f"baseline {check.spec.baseline} is unreadable ({exc.message})"
    if (other := _other_model(check, baseline, profile)) is not None:
        return (), (
            f"baseline {check.spec.baseline} is a profile of another model ({other[0]}, not "
            f"{other[1]}), so nothing is compared with it; give this check its own "
            "baseline file and write it with `memplan check --update-baseline`"
        )
    notes = []
    env_new, env_old = profile.environment, baseline.environment
    for attribute in ("device", "precision"):
        old, new = getattr(env_old, attribute), getattr(env_new, attribute)
        if old != new:
            notes.append(f"baseline was probed with {attribute} {old}, now {new}")
    return diff_profiles(baseline, profile), "; ".join(notes)


def _other_model(
    check: ResolvedCheck, baseline: Profile, profile: Profile
) -> tuple[str, str] | None:
    """(the model ``baseline`` records, ``check``'s) as written, when they are two models
    (two files, resolved against the config's folder, or two factories); else None. A
    model that changed keeps its path: its growth is what the baseline is for."""
    old, new = baseline.model, profile.model
    if old.factory != new.factory:
        return (
            f"{split_model_arg(old.path)[0]}:{old.factory}",
            f"{split_model_arg(check.spec.model)[0]}:{new.factory}",
        )
    if _model_file(old.path, check.root) != _model_file(check.spec.model, check.root):
        return old.path, check.spec.model
    return None


def _model_file(text: str, root: Path) -> str:
    """A model reference's file, resolved against ``root`` (an ``hf:`` reference as is)."""
    if is_hf_reference(text):
        return text.strip()
    path = Path(split_model_arg(text)[0])
    return str((path if path.is_absolute() else root / path).resolve())


def check_baseline_target(check: ResolvedCheck, source: str) -> Path:
    """The resolved path ``--update-baseline`` may write for ``check``, or a BadInputError
    (exit 2) naming ``checks[i].baseline``: outside the config's tree, not a regular file,
    or a file that is not a memplan profile (a model's source, the config itself)."""
    assert check.baseline_path is not None
    where = f"{check.field_path}.baseline"
    target = check.baseline_path.resolve()
    root = check.root.resolve()
    if not target.is_relative_to(root):
        raise config_error(
            source,
            where,
            f"names {check.spec.baseline!r}, which resolves to {target}, outside the config's "
            f"folder {root}",
            hint="Baselines live beside memplan.yaml (e.g. memplan/baseline/NAME.profile.yaml); "
            "memplan writes nothing outside that tree.",
        )
    if target.exists() or target.is_symlink():
        if not target.is_file():
            raise config_error(
                source,
                where,
                f"names {check.spec.baseline!r}, which is not a regular file",
                hint="Point it at a .profile.yaml file (or a path that does not exist yet).",
            )
        try:
            load_profile(target)
        except MemplanError:
            raise config_error(
                source,
                where,
                f"names {check.spec.baseline!r}, which exists and is not a memplan profile; "
                "memplan will not overwrite it",
                hint="Point it at a new path (e.g. memplan/baseline/NAME.profile.yaml), or "
                "delete the file yourself if it really is a stale baseline.",
            ) from None
    return target


def write_baseline(check: ResolvedCheck, profile: Profile, source: str) -> None:
    """Replace ``check``'s baseline with ``profile`` (atomically), after checking the target
    again: the file may have changed since the run began."""
    target = check_baseline_target(check, source)
    try:
        write_text_atomic(target, profile_to_yaml(profile), force=True)
    except OSError as exc:
        raise BadInputError(
            f"cannot write baseline {target}: {exc.strerror or exc}.",
            hint="Check the folder's permissions.",
        ) from None


def _params_bytes(part: Layer | FixedPart) -> int:
    return int(part.params_trainable_bytes + part.params_frozen_bytes)


def _activation_per_sample(profile: Profile) -> float:
    return float(sum(p.saved_bytes.slope for p in (*profile.layers, *profile.fixed)))


def _fold_children(
    parts: dict[str, tuple[float, float]], other: dict[str, tuple[float, float]]
) -> None:
    """Sum into their container the parts that ``other`` has only whole: a profile written
    before memplan split a plain ``ModuleList`` among the fixed parts into its children
    (``transformer.attentions`` then, ``transformer.attentions.0`` and ``.1`` now) is
    compared container to container, not as one part removed and two new."""
    wholes = {n for n in other if n not in parts}
    for name in [n for n in parts if n not in other]:
        pieces = name.split(".")
        ancestors = (".".join(pieces[:i]) for i in range(len(pieces) - 1, 0, -1))
        whole = next((a for a in ancestors if a in wholes), None)
        if whole is not None:
            child = parts.pop(name)
            total = parts.setdefault(whole, (0.0, 0.0))
            parts[whole] = (total[0] + child[0], total[1] + child[1])


def diff_profiles(baseline: Profile, current: Profile) -> tuple[Growth, ...]:
    """What changed from ``baseline`` to ``current``, matched by layer and fixed-part name:
    parameter bytes and activation bytes per sample (the slope of the bytes a part's forward
    keeps for backward), and the whole-model totals. Changes below 1% or 1 KiB are dropped as
    noise; the largest growth comes first."""
    out: list[Growth] = []

    def add(
        name: str, kind: GrowthKind, quantity: Quantity, old: float | None, new: float | None
    ) -> None:
        if old is None or new is None:
            if (old or new or 0) != 0:
                out.append(
                    Growth(name=name, kind=kind, quantity=quantity, baseline=old, current=new)
                )
            return
        delta = new - old
        if abs(delta) >= max(GROWTH_MIN_BYTES, GROWTH_MIN_FRACTION * abs(old)):
            out.append(Growth(name=name, kind=kind, quantity=quantity, baseline=old, current=new))

    parts: tuple[
        tuple[GrowthKind, tuple[Layer | FixedPart, ...], tuple[Layer | FixedPart, ...]], ...
    ]
    parts = (("fixed", baseline.fixed, current.fixed), ("layer", baseline.layers, current.layers))
    for kind, old_list, new_list in parts:
        old_parts = {p.name: (_params_bytes(p), float(p.saved_bytes.slope)) for p in old_list}
        new_parts = {p.name: (_params_bytes(p), float(p.saved_bytes.slope)) for p in new_list}
        _fold_children(new_parts, old_parts)
        _fold_children(old_parts, new_parts)
        for name in list(old_parts) + [n for n in new_parts if n not in old_parts]:
            old, new = old_parts.get(name), new_parts.get(name)
            for i, quantity in enumerate(("params_bytes", "activation_bytes_per_sample")):
                add(
                    name,
                    kind,
                    quantity,  # type: ignore[arg-type]
                    None if old is None else old[i],
                    None if new is None else new[i],
                )

    old_t, new_t = baseline.totals, current.totals
    add(
        "(total)",
        "total",
        "params_bytes",
        old_t.params_trainable_bytes + old_t.params_frozen_bytes,
        new_t.params_trainable_bytes + new_t.params_frozen_bytes,
    )
    add("(total)", "total", "grad_bytes", old_t.grad_bytes, new_t.grad_bytes)
    add(
        "(total)",
        "total",
        "optimizer_state_bytes",
        old_t.optimizer_state_bytes,
        new_t.optimizer_state_bytes,
    )
    add(
        "(total)",
        "total",
        "activation_bytes_per_sample",
        _activation_per_sample(baseline),
        _activation_per_sample(current),
    )
    order = {"layer": 0, "fixed": 0, "total": 1}
    out.sort(key=lambda g: (order[g.kind], -g.delta))
    return tuple(out)
