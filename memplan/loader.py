"""Import a user's model file and hold it to the model-file contract (docs/design.md, "The model file").

A model file defines ``build_model()`` and ``make_batch(batch_size)``, optionally
``training_loss(model, batch)`` and ``make_optimizer(model)``; ``model.py:other_factory``
selects another factory than ``build_model``. Every way a file can break the contract is a
``ModelFileError`` that names the file and function, and an exception raised by the user's
code is reported at the user's own ``file:line``, not at memplan's frames.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.errors import CannotMeasureError, Interrupted, MemplanError, ModelFileError
from memplan.profile import DEFAULT_FACTORY, model_arg, split_model_arg


def _user_location(exc: BaseException, path: Path) -> str:
    """``file:line`` of the innermost frame of ``exc`` inside the user's file, else the
    innermost frame outside memplan, else the file itself."""
    frames = traceback.extract_tb(exc.__traceback__)
    resolved = str(path.resolve())
    inside = [
        f
        for f in frames
        if f.filename and Path(f.filename).resolve().as_posix() == Path(resolved).as_posix()
    ]
    if inside:
        return f"{path}:{inside[-1].lineno}"
    memplan_dir = str(Path(__file__).resolve().parent)
    outside = [f for f in frames if not str(Path(f.filename).resolve()).startswith(memplan_dir)]
    if outside:
        return f"{outside[-1].filename}:{outside[-1].lineno}"
    return str(path)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _out_of_host_memory(exc: BaseException) -> bool:
    """MemoryError, or torch's CPU allocator failing ("DefaultCPUAllocator: can't allocate
    memory"): the machine, not the model file, is at fault."""
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


def _args_text(args: tuple[Any, ...]) -> str:
    return f"({args[0]})" if args and isinstance(args[0], int) else "()"


def _is_passthrough(exc: BaseException) -> bool:
    """Errors that are not the user's fault or that callers handle themselves."""
    if isinstance(exc, MemplanError | KeyboardInterrupt | SystemExit | Interrupted):
        return True
    return type(exc).__name__ == "OutOfMemoryError"  # torch.cuda.OutOfMemoryError, no import


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def is_tensor_batch(batch: Any) -> bool:
    """A tensor, a tuple/list of tensors or a dict of tensors (nesting allowed)."""
    tensor = _tensor_type()
    if isinstance(batch, tensor):
        return True
    if isinstance(batch, tuple | list):
        return len(batch) > 0 and all(is_tensor_batch(item) for item in batch)
    if isinstance(batch, dict):
        return len(batch) > 0 and all(is_tensor_batch(item) for item in batch.values())
    return False


def map_batch(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor of a batch, keeping its structure."""
    tensor = _tensor_type()
    if isinstance(batch, tensor):
        return fn(batch)
    if isinstance(batch, tuple | list):
        items = [map_batch(item, fn) for item in batch]
        return type(batch)(items) if isinstance(batch, list) else tuple(items)
    if isinstance(batch, dict):
        return {key: map_batch(value, fn) for key, value in batch.items()}
    return batch


def batch_tensors(batch: Any) -> list[Any]:
    out: list[Any] = []
    map_batch(batch, out.append)
    return out


def move_batch(batch: Any, device: Any) -> Any:
    """The batch on ``device`` (memplan moves batches itself; model files make them on CPU)."""
    return map_batch(batch, lambda t: t.to(device))


@dataclass(kw_only=True, slots=True)
class ModelFile:
    """A loaded model file. Calls into the user's code go through methods that turn the
    user's exceptions into ``ModelFileError`` at the user's ``file:line``."""

    path: Path
    factory: str
    module: Any
    sha256: str
    has_training_loss: bool = False
    has_make_optimizer: bool = False

    @property
    def spec(self) -> str:
        """The model argument as a user would type it."""
        return model_arg(str(self.path), self.factory)

    def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self.module, name)
        try:
            return fn(*args)
        except BaseException as exc:
            if _is_passthrough(exc):
                raise
            if _out_of_host_memory(exc):
                raise CannotMeasureError(
                    f"Out of host memory in {name}{_args_text(args)} ({_describe(exc)}).",
                    hint="The size asked for does not fit this machine: use a smaller "
                    "micro-batch, or plan for this machine's memory.",
                ) from exc
            raise ModelFileError(
                f"{_user_location(exc, self.path)}: {name}() raised {_describe(exc)}",
                hint=f"Fix {name}() in {self.path}; memplan runs it as a training script would.",
            ) from exc

    def build_model(self) -> Any:
        import torch

        model = self._call(self.factory)
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.path}: {self.factory}() returned {type(model).__name__}, not a torch.nn.Module."
            )
        if not any(p.requires_grad for p in model.parameters()):
            raise ModelFileError(
                f"{self.path}: the model from {self.factory}() has no trainable parameters; "
                "there is nothing to train and nothing to plan.",
                hint="Leave requires_grad=True on at least one parameter.",
            )
        return model

    def make_batch(self, batch_size: int) -> Any:
        batch = self._call("make_batch", batch_size)
        if not is_tensor_batch(batch):
            raise ModelFileError(
                f"{self.path}: make_batch({batch_size}) returned {type(batch).__name__}; "
                "it must return a tensor, a tuple/list of tensors or a dict of tensors.",
                hint="Return tensors on CPU; memplan moves them to the device.",
            )
        if any(getattr(t, "is_meta", False) for t in batch_tensors(batch)):
            raise ModelFileError(
                f"{self.path}: make_batch({batch_size}) returned meta tensors, which hold "
                "no data to train on.",
                hint="Return real tensors on CPU; memplan moves them to the device itself "
                "(also to meta for --device meta).",
            )
        return batch

    def loss(self, model: Any, batch: Any) -> Any:
        """The scalar loss of one micro-batch: ``training_loss`` if the file has it, else the
        model's output (a scalar, or something with ``.loss``)."""
        import torch

        if self.has_training_loss:
            out = self._call("training_loss", model, batch)
            where = "training_loss(model, batch)"
        else:
            try:
                if isinstance(batch, dict):
                    out = model(**batch)
                elif isinstance(batch, tuple | list):
                    out = model(*batch)
                else:
                    out = model(batch)
            except BaseException as exc:
                if _is_passthrough(exc):
                    raise
                raise ModelFileError(
                    f"{_user_location(exc, self.path)}: the model's forward raised {_describe(exc)}",
                    hint=f"Check that make_batch() in {self.path} produces what the model takes.",
                ) from exc
            where = "the model's output"
            if not isinstance(out, torch.Tensor):
                loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
                out = loss if loss is not None else out
        if not (isinstance(out, torch.Tensor) and out.dim() == 0 and out.is_floating_point()):
            kind = (
                f"a tensor of shape {tuple(out.shape)}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            raise ModelFileError(
                f"{self.path}: {where} is {kind}, not a scalar loss.",
                hint="Define training_loss(model, batch) returning a scalar loss tensor, or make "
                "the model return one (or an object with .loss).",
            )
        return out

    def make_optimizer(self, model: Any, *, lr: float = 1e-4) -> Any:
        """The file's ``make_optimizer(model)``, else AdamW(lr) over the trainable parameters."""
        import torch

        if self.has_make_optimizer:
            opt = self._call("make_optimizer", model)
            if not isinstance(opt, torch.optim.Optimizer):
                raise ModelFileError(
                    f"{self.path}: make_optimizer() returned {type(opt).__name__}, "
                    "not a torch.optim.Optimizer."
                )
            return opt
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def load_model_file(
    spec: str | Path, factory: str | None = None, *, search_dir: str | Path | None = None
) -> ModelFile:
    """Import ``spec`` (``path.py`` or ``path.py:factory``) and check what the contract
    requires of the file itself; calls to its functions are checked as they are made.
    A relative path that does not exist is also looked up in ``search_dir`` (emitted
    training scripts pass their own folder)."""
    if isinstance(spec, Path):
        path_text, selected = str(spec), DEFAULT_FACTORY
    else:
        path_text, selected = split_model_arg(spec)
    factory = factory or selected
    path = Path(path_text)
    if not path.exists() and not path.is_absolute() and search_dir is not None:
        beside = Path(search_dir) / path
        path = beside if beside.exists() else path
    if not path.is_file():
        raise ModelFileError(
            f"Model file {path} does not exist." if not path.exists() else f"{path} is not a file.",
            hint="Pass a Python file that defines build_model() and make_batch(batch_size).",
        )
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    module_name = f"memplan_user_model_{digest[:16]}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ModelFileError(f"{path}: cannot be imported as a Python file.")
    module = importlib.util.module_from_spec(loader_spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # sibling imports work as they do for `python model.py`
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)
        raise ModelFileError(
            f"{path}:{exc.lineno}: syntax error: {exc.msg}",
            hint="Fix the file; memplan imports it as Python.",
        ) from exc
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt | SystemExit | Interrupted):
            raise
        raise ModelFileError(
            f"{_user_location(exc, path)}: importing the model file raised {_describe(exc)}",
            hint="Fix the error in the model file; memplan runs its top level on import.",
        ) from exc
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    for name in (factory, "make_batch"):
        if not callable(getattr(module, name, None)):
            what = (
                "factory" if name == factory and factory != DEFAULT_FACTORY else "required function"
            )
            raise ModelFileError(
                f"{path}: no {what} `{name}` defined.",
                hint="A model file defines build_model() -> nn.Module and make_batch(batch_size) "
                "(and optionally training_loss(model, batch), make_optimizer(model)).",
            )
    return ModelFile(
        path=path,
        factory=factory,
        module=module,
        sha256=digest,
        has_training_loss=callable(getattr(module, "training_loss", None)),
        has_make_optimizer=callable(getattr(module, "make_optimizer", None)),
    )


class _OsExit(SystemExit):
    """``os._exit`` called by model-file code while :func:`contain_exits` holds it."""


@contextlib.contextmanager
def contain_exits(model: str) -> Iterator[None]:
    """Run model-file code so that it cannot end memplan's process with a code of its own:
    ``sys.exit(n)`` (SystemExit) and ``os._exit(n)`` (replaced for the duration) become a
    ``ModelFileError`` (exit 2) naming the model file. Exits from native code or signals
    are out of reach in-process; docs/contract.md says so."""
    real_exit = os._exit

    def refuse_exit(code: int) -> None:
        raise _OsExit(code)

    os._exit = refuse_exit  # type: ignore[assignment]
    try:
        yield
    except SystemExit as exc:
        how = "os._exit" if isinstance(exc, _OsExit) else "sys.exit"
        path = Path(split_model_arg(model)[0])
        raise ModelFileError(
            f"{_user_location(exc, path)}: the model file called {how}({exc.code!r}); "
            "memplan runs it in its own process, so it must not exit.",
            hint=f"Remove the exit from {path} (guard script code with "
            "`if __name__ == '__main__':`).",
        ) from None
    finally:
        os._exit = real_exit
