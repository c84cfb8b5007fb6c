"""The model reference: the one string that names what memplan plans, as a user types it
(``model.py``, ``model.py:factory`` or ``hf:PATH_OR_ID?task=…``), and what profiles,
plans, configs and emitted scripts carry. Parsing, folding command-line options into it,
resolving it against a config's or a plan's folder. No torch: ``hf:`` references are parsed
by memplan.model.hf, which imports transformers only to build a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import BadInputError, ModelFileError

DEFAULT_FACTORY = "build_model"
"""The factory a model reference without ``:factory`` names."""


def split_model_arg(text: str) -> tuple[str, str]:
    """``"model.py:other_factory"`` → ``("model.py", "other_factory")``; no suffix → the
    default factory. A colon that is part of the path (``C:\\x.py``) is not a selector.
    The one parser of the ``path:factory`` model reference; ``model_arg`` writes it."""
    head, sep, tail = text.rpartition(":")
    if sep and tail.isidentifier() and head and not head.endswith(("\\", "/")):
        return head, tail
    return text, DEFAULT_FACTORY


def model_arg(path: str, factory: str = DEFAULT_FACTORY) -> str:
    """The model reference as a user types it: ``path``, or ``path:factory`` when the
    factory is not the default."""
    return path if factory == DEFAULT_FACTORY else f"{path}:{factory}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRef:
    path: str
    """The model file as given on the command line."""
    factory: str = DEFAULT_FACTORY
    sha256: str = ""
    """Of the model file's bytes, so `check` can tell a changed model from a stale profile."""

    @property
    def spec(self) -> str:
        """The model argument as a user would type it (``path`` or ``path:factory``)."""
        return model_arg(self.path, self.factory)


def is_hf_reference(text: str) -> bool:
    from memplan.model.hf import is_hf_reference as check

    return check(str(text))


def model_reference(
    text: str,
    *,
    task: str | None = None,
    seq_len: int | None = None,
    lora: str | None = None,
    seq_lens: Sequence[int] = (),
) -> str:
    """The model argument of a command, with ``--task`` / ``--seq-len`` / ``--lora`` folded
    into an ``hf:`` reference (one string that profiles, plans and scripts carry). Those
    options are refused for a model file, which makes its own batches. With ``seq_lens``
    (``--seq-lens``) a reference needs no length of its own: the shortest stands in."""
    from memplan.model import hf

    if hf.is_hf_reference(text):
        return str(
            hf.parse_reference(
                text,
                task=task,
                seq_len=seq_len,
                lora=lora,
                default_seq_len=min(seq_lens) if seq_lens else None,
            )
        )
    given = [
        flag
        for flag, value in (("--task", task), ("--seq-len", seq_len), ("--lora", lora))
        if value is not None
    ]
    if given:
        raise BadInputError(
            f"{', '.join(given)} only apply to an hf: reference, not to the model file {text}.",
            hint="A model file makes its own model and batches; drop the option, or write "
            "hf:PATH_OR_ID to build a Hugging Face model from its config.",
        )
    return text


def resolve_model_reference(text: str, base: Path) -> str:
    """A model reference from a config file (memplan.yaml) with relative paths made
    relative to ``base``, the config's folder: ``model.py``, ``model.py:factory`` or an
    ``hf:`` reference with a local config. Raises ModelFileError naming what is missing."""
    from memplan.model import hf

    if hf.is_hf_reference(text):
        return str(hf.resolve_against(hf.parse_reference(text), base))
    path_text, factory = split_model_arg(text)
    path = Path(path_text) if Path(path_text).is_absolute() else base / path_text
    if not path.is_file():
        raise ModelFileError(
            f"names {text!r}, and {path} does not exist",
            hint="Paths are relative to the config file.",
        )
    return str(path) if factory == DEFAULT_FACTORY else f"{path}:{factory}"


def reference_path(text: str) -> Path:
    """The file or folder a model reference reads: the model file, or an ``hf:``
    reference's config source (a local directory or config.json, or a hub id)."""
    from memplan.model import hf

    if hf.is_hf_reference(text):
        return Path(hf.parse_reference(text).source)
    return Path(split_model_arg(text)[0])


def relative_reference(text: str, folder: Path) -> str:
    """``text`` with a relative local path rewritten relative to ``folder`` (where an
    emitted script is written, which resolves paths against its own folder); absolute
    paths, hub ids and paths that do not exist here are kept as they are."""
    import os

    from memplan.model import hf

    if hf.is_hf_reference(text):
        ref = hf.parse_reference(text)
        local = ref.local_path()
        if local is None or local.is_absolute() or not local.exists():
            return text
        return str(ref.with_source(os.path.relpath(local.resolve(), folder.resolve())))
    path_text, factory = split_model_arg(text)
    path = Path(path_text)
    if path.is_absolute() or not path.exists():
        return text
    moved = os.path.relpath(path.resolve(), folder.resolve())
    return moved if factory == DEFAULT_FACTORY else f"{moved}:{factory}"


def planned_model_reference(
    given: str | None,
    planned: str,
    plan_dir: Path,
    *,
    task: str | None = None,
    seq_len: int | None = None,
    lora: str | None = None,
) -> str:
    """The model a command runs for a plan: ``given`` when the user typed one, else the
    plan's own reference (a relative path that is not found here is looked for beside the
    plan). Of an ``hf:`` reference, ``--task`` / ``--seq-len`` / ``--lora`` and the options
    in ``given`` win; what neither says comes from the plan's reference."""
    from memplan.model import hf

    if given is None:
        if hf.is_hf_reference(planned):
            ref = hf.parse_reference(planned, task=task, seq_len=seq_len, lora=lora)
            local = ref.local_path()
            if local is not None and not local.exists():
                ref = hf.resolve_against(ref, plan_dir)
            return str(ref)
        path_text, factory = split_model_arg(planned)
        beside = plan_dir / path_text
        if not Path(path_text).exists() and not Path(path_text).is_absolute() and beside.exists():
            planned = str(beside) if factory == DEFAULT_FACTORY else f"{beside}:{factory}"
        return model_reference(planned, task=task, seq_len=seq_len, lora=lora)
    if hf.is_hf_reference(given) and hf.is_hf_reference(planned):
        plan_ref = hf.parse_reference(planned)
        query = given.partition("?")[2]
        present = {part.partition("=")[0] for part in query.split("&") if part}
        task = task or (None if "task" in present else plan_ref.task)
        if seq_len is None and "seq-len" not in present:
            seq_len = plan_ref.seq_len
        if lora is None and "lora" not in present and plan_ref.lora is not None:
            lora = str(plan_ref.lora)
    return model_reference(given, task=task, seq_len=seq_len, lora=lora)


def located_model(spec: str, sha256: str, profile_path: Path) -> tuple[str, str]:
    """A profile's model file as it is reached from here, and a warning ('' for none).

    A profile records the model's path as ``probe`` was given it, relative to where it ran.
    Solved from another folder, that path named nothing, and the plan and its scripts
    pointed at no file, without a word. Where the recorded path does not exist from here,
    the file is looked for relative to the profile's folder and each folder above it, and
    taken where its bytes are the ones probed (``sha256``); else the recorded path is
    kept, with a warning naming ``--model``. Absolute paths, ``hf:`` references and paths
    found from here are returned unchanged."""
    import os

    from memplan.model import hf

    if hf.is_hf_reference(spec):
        return spec, ""
    path_text, factory = split_model_arg(spec)
    path = Path(path_text)
    if path.exists():
        return spec, ""
    # an absolute path from another machine or folder: looked for by its file name
    tail = Path(path.name) if path.is_absolute() else path
    for folder in (profile_path.resolve().parent, *profile_path.resolve().parents):
        candidate = folder / tail
        try:
            found = candidate.is_file() and _sha256(candidate) == sha256
        except OSError:
            continue
        if found:
            return model_arg(os.path.relpath(candidate), factory), ""
    where = "" if path.is_absolute() else " (a path relative to where it was probed)"
    return spec, (
        f"the profile's model file {path_text}{where} is not found from here, nor from "
        f"{profile_path}'s folder or any above it, so the plan and its scripts name a file "
        "that may not exist. Pass --model PATH to name it, or solve from the folder the "
        "probe ran in."
    )


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def given_model_note(given: str, sha256: str, probed: str) -> str:
    """A warning for ``solve --model`` ('' for none): the file named is not found here (it
    may name the file as the training machine sees it), or is not the file probed (its
    bytes differ from the profile's ``sha256``). Before, any path was written into the plan
    and its scripts without a word, and the torch script trained another model with the
    plan's numbers, a plan ``verify`` then refused as made for another model."""
    from memplan.model import hf

    if hf.is_hf_reference(given) or not sha256:
        return ""
    path_text, _ = split_model_arg(given)
    path = Path(path_text)
    try:
        if not path.is_file():
            return (
                f"--model {path_text} is not a file here: the plan and its scripts name it as "
                "given, so it must exist where they run."
            )
        if _sha256(path) == sha256:
            return ""
    except OSError:
        return ""
    return (
        f"--model {path_text} is not the file the profile measured ({probed}): its bytes "
        "differ, so the plan's numbers are another file's, and verify refuses the plan if "
        "the model's parameters differ. Probe it (memplan probe) and solve that profile, or "
        "drop --model."
    )
