"""Domain errors: every failure a user can cause or meet, each with its exit code.

The CLI catches ``MemplanError`` in one place and turns it into one paragraph on stderr and
``exit_code``; library callers get the exception. Codes follow docs/design.md ("Exit codes"):
0 ok · 1 over budget / no plan fits · 2 bad input or usage · 3 cannot measure.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_OVER_BUDGET = 1
EXIT_BAD_INPUT = 2
EXIT_CANNOT_MEASURE = 3


class MemplanError(Exception):
    """Base class. ``message`` says what went wrong (naming the file, field or op);
    ``hint`` says what to do about it."""

    exit_code: int = EXIT_BAD_INPUT

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if not self.hint:
            return self.message
        stop = "" if self.message.rstrip().endswith((".", "!", "?", ":")) else "."
        return f"{self.message}{stop} {self.hint}"


KNOWN_EXIT_CODES = (EXIT_OVER_BUDGET, EXIT_BAD_INPUT, EXIT_CANNOT_MEASURE)
"""The codes a MemplanError may end a command with (0 is success, never an error's)."""


def exit_code_of(exc: MemplanError) -> int:
    """The exit code ``exc`` ends a command with: its own when memplan defines its class and
    the code is one of ``KNOWN_EXIT_CODES``; else 2, bad input: a ``MemplanError`` subclass
    from a model file (or a code that is not memplan's) is the model file's error, so no
    model file chooses memplan's exit code."""
    code = getattr(exc, "exit_code", EXIT_BAD_INPUT)
    ours = type(exc).__module__.startswith("memplan.")
    return code if ours and type(code) is int and code in KNOWN_EXIT_CODES else EXIT_BAD_INPUT


class BadInputError(MemplanError):
    """The user gave something memplan cannot use (a size string, a flag combination)."""

    exit_code = EXIT_BAD_INPUT


class ModelFileError(BadInputError):
    """model.py is missing, does not import, or breaks the model-file contract."""


class MissingExtraError(BadInputError, ImportError):
    """An integration's framework (transformers, lightning, accelerate) is not installed;
    the message names the memplan extra that installs it."""


class ProfileError(BadInputError):
    """A profile or plan YAML file is unreadable, corrupted, of a future version, or has
    unknown keys."""


class OutputExistsError(BadInputError):
    """Refusing to overwrite an existing file without --force."""


class NoPlanFitsError(MemplanError):
    """No configuration fits the budget. Carries the closest plan and the least memory any
    plan needs, so the caller can say what would make it fit."""

    exit_code = EXIT_OVER_BUDGET

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        min_peak_bytes: int | None = None,
        closest=None,
    ) -> None:  # closest: memplan.plan.Plan | None
        super().__init__(message, hint=hint)
        self.min_peak_bytes = min_peak_bytes
        self.closest = closest


class CannotMeasureError(MemplanError):
    """The probe cannot measure this model here: an op without a meta kernel, a
    data-dependent shape on meta, out of memory at the smallest size, no GPU for cuda."""

    exit_code = EXIT_CANNOT_MEASURE


class InternalError(CannotMeasureError):
    """memplan's own machinery failed while the user's code ran: a CPU twin, the live
    tracker, the meta op cache, meta attention or autocast. It is raised (by
    ``internal_failure``) at the point where memplan's code calls its own helpers, so it is
    never a user's error: the loader lets it pass through the user's functions unchanged
    (never a ``ModelFileError`` at the user's line), and it names memplan's op."""

    exit_code = EXIT_CANNOT_MEASURE


class UnreadableOutputError(CannotMeasureError):
    """A profile or plan memplan made would be refused when read back (its YAML, the
    schema, or ``profile_problem``/``plan_problem``): memplan's own failure, never the
    user's. Raised by the writers' text functions (``profile_to_yaml``, ``plan_to_yaml``)
    before any file is written, so no command leaves a file that memplan then calls
    edited or corrupted."""

    exit_code = EXIT_CANNOT_MEASURE


def unreadable_output(what: str, problem: str) -> UnreadableOutputError:
    """The error for a ``what`` (``profile``/``plan``) memplan made whose read-back says
    ``problem`` (naming the field)."""
    return UnreadableOutputError(
        f"memplan made a {what} that it would refuse to read back: {problem}. It was not "
        f"written: this is memplan's failure, not the model file's",
        hint="Report this message with the model file. Probing other --micro-batches may "
        "measure around it meanwhile.",
    )


def first_line(exc: BaseException, default: str = "") -> str:
    """The first line of ``exc``'s message (``default`` when it has none): what an error
    of memplan's quotes of another."""
    return (str(exc).strip().splitlines() or [default])[0]


def internal_failure(part: str, op: object, exc: BaseException) -> InternalError:
    """``exc``, raised inside memplan's ``part`` while handling ``op`` (an aten op, or
    what a hook was doing), as memplan's own failure (exit 3) naming both."""
    first = first_line(exc)
    what = op if isinstance(op, str) else f"op {op}"
    known = InternalError(
        f"memplan's {part} failed on {what}: {type(exc).__name__}: {first[:300]}. This is "
        "memplan's failure, not the model file's",
        hint="Probe with --device cpu (or cuda) meanwhile, and report this message.",
    )
    known.__cause__ = exc
    return known


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException, like KeyboardInterrupt, so nothing that
    catches ``Exception`` swallows it and cleanups (``finally``) run; the console script
    prints one line and exits 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class CheckpointingError(CannotMeasureError):
    """The model does not run under activation checkpointing: its recompute during the
    backward differs from its forward (a cache or other state the forward changes,
    randomness outside the preserved RNG state, data-dependent control flow)."""


def raised_by_checkpointing(exc: BaseException) -> bool:
    """Whether activation checkpointing raised ``exc``: torch's ``CheckpointError`` (the
    recompute saved other tensors than the forward), or any error raised while a layer was
    recomputed in the backward (``torch/utils/checkpoint.py`` on its way up)."""
    import traceback

    return type(exc).__name__ == "CheckpointError" or any(
        frame.filename.replace("\\", "/").endswith("torch/utils/checkpoint.py")
        for frame in traceback.extract_tb(exc.__traceback__)
    )


def checkpointing_failure(exc: BaseException, where: str) -> CheckpointingError | None:
    """``exc`` as a ``CheckpointingError`` when it was raised by activation checkpointing
    (``torch.utils.checkpoint.CheckpointError``, or any error raised while it recomputed a
    layer during the backward), else None. ``where`` names the model file or reference."""
    if isinstance(exc, MemplanError) or not raised_by_checkpointing(exc):
        return None
    first = first_line(exc, type(exc).__name__)
    known = CheckpointingError(
        f"{where}: activation checkpointing failed while recomputing a layer in the "
        f"backward: {type(exc).__name__}: {first[:300]}",
        hint="The layer's recompute does not match its forward: state that the forward "
        "changes (a key/value cache, a counter), or randomness torch does not replay. "
        "Switch such state off for training, or leave the layer out with --layers GLOB.",
    )
    known.__cause__ = exc
    return known
