"""``hf:`` model references: a Hugging Face model built from its config alone.

``hf:PATH_OR_ID?task=causal-lm&seq-len=64[&lora=r=16,alpha=32,targets=q_proj,v_proj]``
names a model without a model file: the config comes from a local directory holding
``config.json``, a ``config.json`` file, or a hub id (``AutoConfig.from_pretrained``: the
config only, never weights); the model is ``AutoModelFor<task>.from_config`` (random
weights); batches are synthetic (token ids, an all-ones attention mask, labels), seeded by
their size; ``lora=`` wraps the model with peft's LoRA. The reference is one string, so it
travels unchanged through profiles, plans, ``memplan.yaml`` checks and emitted scripts.

This module only parses and formats references; ``build_module`` (which imports torch and
transformers) turns one into the functions of the model-file contract.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.errors import BadInputError, ModelFileError, first_line

PREFIX = "hf:"
TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "seq-cls": "AutoModelForSequenceClassification",
    "masked-lm": "AutoModelForMaskedLM",
}
_LORA_KEYS = {"r", "alpha", "dropout", "targets"}
_FORMAT = "hf:PATH_OR_ID?task=causal-lm&seq-len=64[&lora=r=16,alpha=32,targets=q_proj,v_proj]"


def is_hf_reference(text: str) -> bool:
    return str(text).startswith(PREFIX)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    r: int
    """LoRA rank."""
    alpha: int
    """``lora_alpha`` (scale alpha / r)."""
    targets: tuple[str, ...]
    """Module names peft wraps (``target_modules``)."""
    dropout: float = 0.0
    """``lora_dropout``."""

    def __str__(self) -> str:
        text = f"r={self.r},alpha={self.alpha},targets={','.join(self.targets)}"
        return text + (f",dropout={self.dropout:g}" if self.dropout else "")


@dataclass(frozen=True, kw_only=True, slots=True)
class HfReference:
    source: str
    """A local directory or config.json (as written), or a hub id."""
    task: str
    """One of ``TASKS``."""
    seq_len: int
    """Tokens per sample of the synthetic batches."""
    lora: LoraSpec | None = None

    def __str__(self) -> str:
        text = f"{PREFIX}{self.source}?task={self.task}&seq-len={self.seq_len}"
        return text + (f"&lora={self.lora}" if self.lora else "")

    def local_path(self, base: Path | None = None) -> Path | None:
        """The config's local path (relative ones against ``base``), or None for a hub id:
        a source that exists on disk, or that looks like a path (``./x``, ``/x``, ``x.json``)."""
        path = Path(self.source)
        if base is not None and not path.is_absolute():
            beside = base / path
            if beside.exists():
                return beside
        looks_local = self.source.startswith((".", "/", "~")) or self.source.endswith(".json")
        return path if path.exists() or looks_local or path.is_absolute() else None

    def with_source(self, source: str) -> HfReference:
        return HfReference(source=source, task=self.task, seq_len=self.seq_len, lora=self.lora)


def parse_lora(text: str) -> LoraSpec:
    """``r=16,alpha=32,targets=q_proj,v_proj`` (targets last: its value holds commas)."""
    fields: dict[str, str] = {}
    key = None
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if sep and name.strip() in _LORA_KEYS:
            key = name.strip()
            fields[key] = value.strip()
        elif key == "targets" and part.strip():
            fields["targets"] += "," + part.strip()
        else:
            raise BadInputError(
                f"--lora {text!r}: cannot read {part!r}.",
                hint="Write r=16,alpha=32,targets=q_proj,v_proj (keys: r, alpha, dropout, "
                "targets; targets last).",
            )
    try:
        r = int(fields["r"])
        alpha = int(fields.get("alpha", 2 * r))
        dropout = float(fields.get("dropout", 0.0))
    except (KeyError, ValueError):
        raise BadInputError(
            f"--lora {text!r} needs an integer r (and an integer alpha, a float dropout).",
            hint="For example r=16,alpha=32,targets=q_proj,v_proj.",
        ) from None
    targets = tuple(t for t in fields.get("targets", "").split(",") if t)
    if r < 1 or not targets or not 0.0 <= dropout < 1.0:
        raise BadInputError(
            f"--lora {text!r}: r must be >= 1, dropout in [0, 1), and targets must name "
            "at least one module.",
            hint="For example r=16,alpha=32,targets=q_proj,v_proj.",
        )
    return LoraSpec(r=r, alpha=alpha, targets=targets, dropout=dropout)


def parse_reference(
    text: str,
    *,
    task: str | None = None,
    seq_len: int | None = None,
    lora: str | None = None,
    default_seq_len: int | None = None,
) -> HfReference:
    """An ``hf:`` reference from its text, the options in it overridden by ``task``,
    ``seq_len`` and ``lora`` (the CLI's ``--task``, ``--seq-len``, ``--lora``);
    ``default_seq_len`` is the length when neither names one (``--seq-lens``, whose
    lengths replace it at each probe)."""
    if not is_hf_reference(text):
        raise BadInputError(f"{text!r} is not an hf: reference.", hint=f"Write {_FORMAT}.")
    body = text[len(PREFIX) :]
    source, _, query = body.partition("?")
    options: dict[str, str] = {}
    for part in query.split("&") if query else []:
        name, sep, value = part.partition("=")
        if not sep or name not in ("task", "seq-len", "lora"):
            raise BadInputError(
                f"{text!r}: unknown option {part!r}.",
                hint=f"Options are task, seq-len and lora: {_FORMAT}.",
            )
        options[name] = value
    task = task or options.get("task")
    seq_text = str(seq_len) if seq_len is not None else options.get("seq-len")
    if seq_text is None and default_seq_len is not None:
        seq_text = str(default_seq_len)
    lora_text = lora if lora is not None else options.get("lora")
    if not source:
        raise BadInputError(f"{text!r} names no config.", hint=f"Write {_FORMAT}.")
    if task not in TASKS:
        raise BadInputError(
            f"{text!r}: task {task!r} is not one of {', '.join(TASKS)}."
            if task
            else f"{text!r} needs a task.",
            hint="Pass --task causal-lm|seq2seq-lm|seq-cls|masked-lm.",
        )
    try:
        seq = int(seq_text) if seq_text is not None else 0
    except ValueError:
        seq = 0
    if seq < 1:
        raise BadInputError(
            f"{text!r} needs a positive sequence length"
            + (f", got {seq_text!r}." if seq_text else "."),
            hint="Pass --seq-len N (tokens per sample of the synthetic batches).",
        )
    return HfReference(
        source=source, task=task, seq_len=seq, lora=parse_lora(lora_text) if lora_text else None
    )


def resolve_against(ref: HfReference, base: Path) -> HfReference:
    """``ref`` with a relative local config path made relative to ``base`` instead of the
    current directory (a config path in memplan.yaml is relative to that file)."""
    local = ref.local_path(base)
    if local is None:
        return ref
    if not local.exists():
        raise ModelFileError(
            f"{ref}: the config {local} does not exist.",
            hint="Give a directory holding config.json, a config.json file, or a hub id.",
        )
    return ref.with_source(str(local))


# --------------------------------------------------------------------------- building
def _load_config(ref: HfReference) -> Any:
    from transformers import AutoConfig

    local = ref.local_path()
    if local is not None:
        if not local.exists():
            raise ModelFileError(
                f"{ref}: the config {local} does not exist.",
                hint="Give a directory holding config.json, a config.json file, or a hub id.",
            )
        if local.is_dir() and not (local / "config.json").is_file():
            raise ModelFileError(
                f"{ref}: {local} holds no config.json.",
                hint="Point at the folder of a Hugging Face model (its config.json is enough).",
            )
        _refuse_remote_code(ref, local / "config.json" if local.is_dir() else local)
    try:
        # trust_remote_code=False: never run a model's own code, never ask on stdin;
        # local_files_only: a local config never goes to the Hub.
        return AutoConfig.from_pretrained(
            str(local) if local is not None else ref.source,
            trust_remote_code=False,
            local_files_only=local is not None,
        )
    except (OSError, ValueError, KeyError) as exc:
        first = first_line(exc, type(exc).__name__)
        if "trust_remote_code" in str(exc) or "auto_map" in str(exc):
            raise _remote_code_error(ref, ref.source) from exc
        raise ModelFileError(
            f"{ref}: transformers cannot read the config: {first[:300]}",
            hint="Check the path or hub id, and that config.json names a model_type this "
            "transformers knows (memplan reads the config only, never weights).",
        ) from exc


def _remote_code_error(ref: HfReference, where: object, names: str = "") -> ModelFileError:
    return ModelFileError(
        f"{ref}: the config at {where} has `auto_map`{names}: the model is custom code that "
        "ships with it. memplan never runs a model's own code (trust_remote_code=False).",
        hint="Use a config whose model_type this transformers knows, or write a model file "
        "(model.py) that builds the model from code you have read.",
    )


def _refuse_remote_code(ref: HfReference, config_file: Path) -> None:
    """ModelFileError (exit 2) naming ``auto_map`` when ``config_file`` names custom code
    (``configuration_*.py`` / ``modeling_*.py`` beside it, or a Hub repository's)."""
    import json

    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers says what is wrong with it
    if isinstance(data, dict) and "auto_map" in data:
        auto_map = data["auto_map"]
        names = ", ".join(map(str, auto_map)) if isinstance(auto_map, dict) else ""
        raise _remote_code_error(ref, config_file, f" ({names[:200]})" if names else "")


def _max_positions(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def build_module(ref: HfReference) -> types.ModuleType:
    """A module with ``build_model`` and ``make_batch`` (the model-file contract) for ``ref``."""
    import torch
    import transformers

    config = _load_config(ref)
    limit = _max_positions(config)
    if limit is not None and ref.seq_len > limit:
        raise BadInputError(
            f"{ref}: seq-len {ref.seq_len} exceeds the model's {limit} positions.",
            hint=f"Pass --seq-len {limit} or less.",
        )
    auto = getattr(transformers, TASKS[ref.task])
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise ModelFileError(f"{ref}: the config has no vocab_size; it is not a language model.")
    labels = int(getattr(config, "num_labels", 2) or 2)

    def build_model() -> Any:
        torch.manual_seed(0)
        try:
            model = auto.from_config(config, trust_remote_code=False)
        except ValueError as exc:
            first = first_line(exc)
            raise ModelFileError(
                f"{ref}: transformers has no {TASKS[ref.task]} for model_type "
                f"{getattr(config, 'model_type', '?')!r}: {first[:200]}",
                hint="Choose the task this model is for (--task).",
            ) from exc
        if ref.lora is not None:
            from peft import LoraConfig, get_peft_model

            lora = ref.lora
            _refuse_unmatched_targets(model, lora.targets)
            model = get_peft_model(
                model,
                LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.targets),
                ),
            )
        return model

    def make_batch(batch_size: int, seq_len: int | None = None) -> dict[str, Any]:
        seq = ref.seq_len if seq_len is None else seq_len
        if limit is not None and seq > limit:
            raise BadInputError(
                f"{ref}: seq-len {seq} exceeds the model's {limit} positions.",
                hint=f"Plan and probe lengths of {limit} or less.",
            )
        g = torch.Generator().manual_seed(1000 + batch_size)
        shape = (batch_size, seq)
        ids = torch.randint(0, vocab, shape, generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones(shape, dtype=torch.long)}
        if ref.task == "seq-cls":
            batch["labels"] = torch.randint(0, labels, (batch_size,), generator=g)
        elif ref.task == "seq2seq-lm":
            batch["labels"] = torch.randint(0, vocab, shape, generator=g)
        else:
            batch["labels"] = ids.clone()
        return batch

    module = types.ModuleType(f"memplan_hf_{abs(hash(str(ref))):x}")
    module.build_model = build_model  # type: ignore[attr-defined]
    module.make_batch = make_batch  # type: ignore[attr-defined]
    module.max_seq_len = limit  # type: ignore[attr-defined]
    return module


def _refuse_unmatched_targets(model: Any, targets: tuple[str, ...]) -> None:
    """``--lora targets=`` that name no module of the model: peft matches a target to a
    module whose name is the target or ends in ``.target``, and raises when none matches.
    Its error reached the user as "Fix build_model() in <config.json>" (the generic hint
    for a model file's failure); this one names --lora and the model's linear layers."""
    import torch

    names = [name for name, _ in model.named_modules() if name]
    if any(name == t or name.endswith(f".{t}") for t in targets for name in names):
        return
    linear = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        }
    )
    shown = ", ".join(linear[:12]) + (", …" if len(linear) > 12 else "")
    raise BadInputError(
        f"--lora targets={','.join(targets)} match no module of {type(model).__name__}; "
        f"its linear layers are named {shown or '(none)'}.",
        hint="Name some of them in targets=, e.g. targets=" + ",".join(linear[:2]) + ".",
    )
