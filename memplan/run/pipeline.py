"""Pipeline stages of a transformers decoder (issue 25, made exact in issue 37): where its
pieces live (``pipeline_parts``, from its own pipeline plan), a stage's forward
(``stage_forward``: exactly what the whole model computes there), the model pruned to one
stage (``make_stage_module``), and the check that a split computes the model's forward
(``check_pipeline_split``), which ``build_layout`` runs before splitting and the probe
records (``pipeline_refusal`` -> ``Profile.pipeline_refused``) so ``solve`` plans no stages
memplan cannot run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memplan.errors import BadInputError
from memplan.parallel import StageSplit, split_stages


class SkippedLayer(torch.nn.Module):
    """A layer of another pipeline stage: passes the hidden states through."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineParts:
    """Where a decoder model's pipeline pieces live, by fully-qualified name."""

    base: str
    """The base model (called with ``input_ids`` or ``inputs_embeds``)."""
    embed: str
    layers: str
    """The repeated block list (an ``nn.ModuleList``)."""
    norm: str
    head: str


def pipeline_parts(net: torch.nn.Module) -> PipelineParts:
    """A transformers decoder's pieces from its own pipeline plan (``base_model_pp_plan``:
    embeddings, layers, norm; ``_pp_plan``: the head). Other models are refused."""
    config = getattr(net, "config", None)
    base_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    prefix = getattr(net, "base_model_prefix", "") or ""
    # an instance's _pp_plan also holds the base plan under the prefix: the rest is the head
    own = {
        name: value
        for name, value in dict(getattr(net, "_pp_plan", None) or {}).items()
        if not name.startswith(f"{prefix}.")
    }
    names = list(base_plan)
    if (
        len(names) != 3
        or len(own) != 1
        or not isinstance(getattr(net, prefix, None), torch.nn.Module)
    ):
        raise BadInputError(
            f"memplan splits pipeline stages of Hugging Face decoder models (embeddings, "
            f"layers, norm, head in their pipeline plan); {type(net).__name__} declares none.",
            hint="Plan this model without pipeline parallelism (--pp 1).",
        )
    if getattr(config, "tie_word_embeddings", False):
        raise BadInputError(
            f"{type(net).__name__} ties its head to its embeddings, which sit on different "
            "pipeline stages.",
            hint="Set tie_word_embeddings false in the config, or plan with --pp 1.",
        )
    embed, layers, norm = (f"{prefix}.{n}" for n in names)
    return PipelineParts(base=prefix, embed=embed, layers=layers, norm=norm, head=next(iter(own)))


def _set(net: torch.nn.Module, name: str, value: torch.nn.Module | None) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, leaf, value)


def _prune(
    net: torch.nn.Module, parts: PipelineParts, layers: range, *, first: bool, last: bool
) -> dict[str, torch.nn.Module | None]:
    """Prune ``net`` to one stage in place (see ``make_stage_module``); returns what was
    replaced, by name, so ``_restore`` can put it back."""
    block_list = net.get_submodule(parts.layers)
    taken: dict[str, torch.nn.Module | None] = {}
    for index in range(len(block_list)):
        if index not in layers:
            taken[f"{parts.layers}.{index}"] = block_list[index]
            block_list[index] = SkippedLayer()
    if not first:
        taken[parts.embed] = net.get_submodule(parts.embed)
        _set(net, parts.embed, None)
    if not last:
        taken[parts.norm] = net.get_submodule(parts.norm)
        taken[parts.head] = net.get_submodule(parts.head)
        _set(net, parts.norm, torch.nn.Identity())
        _set(net, parts.head, None)
    return taken


def _restore(net: torch.nn.Module, taken: dict[str, torch.nn.Module | None]) -> None:
    for name, module in taken.items():
        _set(net, name, module)


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple | list) else output


def stage_forward(
    net: torch.nn.Module, parts: PipelineParts, layers: range, *, first: bool, last: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """What one pipeline stage of ``net`` computes, exactly as the whole model's forward
    computes it there: the first stage takes token ids, later ones the hidden states the
    previous stage's last layer returned, which go straight into this stage's first layer
    (a forward pre-hook), past whatever the base model does between its embeddings and its
    first layer (Granite's ``embedding_multiplier``, Gemma's ``sqrt(hidden)`` normaliser:
    applied once, on stage 0, not again on each stage). A stage before the last returns its
    last layer's output (a forward hook); the last stage calls the model's own forward, so
    what the causal-LM wrapper does to the head's logits is kept (Granite's
    ``logits_scaling``, Gemma2's final logit softcap)."""
    block_list = net.get_submodule(parts.layers)
    base = net.get_submodule(parts.base)
    whole = type(net).forward
    key = "input_ids" if first else "inputs_embeds"

    def forward(x: torch.Tensor) -> torch.Tensor:
        handles = []
        got: list[torch.Tensor] = []
        if not first:

            def feed(_: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                if args:
                    return (x, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": x}

            handles.append(
                block_list[layers.start].register_forward_pre_hook(
                    feed, with_kwargs=True, prepend=True
                )
            )
        if not last:
            handles.append(
                block_list[layers.stop - 1].register_forward_hook(
                    lambda _m, _a, out: got.append(_hidden(out))
                )
            )
        try:
            if last:
                return whole(net, **{key: x}, use_cache=False).logits
            base(**{key: x}, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return got[-1]

    return forward


def make_stage_module(
    net: torch.nn.Module, parts: PipelineParts, layers: range, *, first: bool, last: bool
) -> torch.nn.Module:
    """``net`` pruned to one pipeline stage, in place: layers outside ``layers`` become
    pass-throughs, the embeddings go unless ``first``, the norm and head unless ``last``.
    Its forward (``stage_forward``) takes token ids (first stage) or hidden states and
    returns hidden states, or the logits on the last stage. Names of what stays are
    unchanged."""
    from memplan.run.checkpoint import remove

    forward = stage_forward(net, parts, layers, first=first, last=last)
    taken = _prune(net, parts, layers, first=first, last=last)
    # A checkpointed block's patched ``forward`` is a method bound to the block in its own
    # ``__dict__``: a reference cycle, which only the cyclic collector frees. Undo the patch
    # on the pruned blocks so they (their parameters) go when the last reference does, as an
    # unpatched block does: measured on 4 gloo ranks (tiny HF Llama, pp 2, every block fully
    # checkpointed), the other stage's blocks stayed alive and each rank held 74,240 B of
    # parameters the stage does not own (issue 31).
    for module in taken.values():
        if module is not None:
            remove(module)
    net.forward = forward  # type: ignore[method-assign]
    return net


SPLIT_CHECK_TOKENS = 8
"""Tokens of the one-sample batch ``check_pipeline_split`` runs."""


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.detach().abs().max().item()
    diff = (got.detach().float() - want.detach().float()).abs().max().item()
    return diff / scale if scale > 0 else diff


def split_tolerance(net: torch.nn.Module) -> float:
    """How far a split's logits may be from the whole model's: the same ops on the same
    values in the same order, so a few units of the parameters' float precision."""
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.float32)
    return 16 * torch.finfo(dtype).eps


def check_pipeline_split(
    net: torch.nn.Module, stages: int | None = None, split: StageSplit = "memplan"
) -> None:
    """Refuse (BadInputError, naming what differs) unless ``net`` split into ``stages``
    pipeline stages by ``split`` (``Parallel.stage_split``; ``stages`` None: every layer its
    own stage, so every split point is tried) computes exactly its forward: on one sample of
    token ids, in eval mode, without gradients, each stage pruned in turn as
    ``make_stage_module`` prunes it and the hidden states handed on, against the whole
    model's logits and each boundary's hidden states."""
    parts = pipeline_parts(net)
    block_list = net.get_submodule(parts.layers)
    n_layers = len(block_list)
    ranges = split_stages(
        n_layers, min(stages or n_layers, n_layers), split if stages else "memplan"
    )
    config = net.config  # type: ignore[union-attr]
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    device = next(net.parameters()).device
    ids = (torch.arange(SPLIT_CHECK_TOKENS, device=device) * 7919 % vocab).unsqueeze(0)
    modes = {m: m.training for m in net.modules()}
    boundary: dict[int, torch.Tensor] = {}
    handles = [
        block_list[r.stop - 1].register_forward_hook(
            lambda _m, _a, out, i=r.stop - 1: boundary.__setitem__(i, _hidden(out))
        )
        for r in ranges[:-1]
    ]
    name = type(net).__name__
    try:
        net.eval()
        with torch.no_grad():
            try:
                want = type(net).forward(net, input_ids=ids, use_cache=False).logits
            finally:
                for handle in handles:
                    handle.remove()
            x = ids
            for stage, layers in enumerate(ranges):
                first, last = stage == 0, stage == len(ranges) - 1
                run_stage = stage_forward(net, parts, layers, first=first, last=last)
                taken = _prune(net, parts, layers, first=first, last=last)
                try:
                    x = run_stage(x)
                finally:
                    _restore(net, taken)
                if not last and _relative(x, boundary[layers.stop - 1]) > split_tolerance(net):
                    raise BadInputError(
                        f"memplan cannot split {name} into pipeline stages: the hidden states "
                        f"after layer {layers.stop - 1} of its split differ from its whole "
                        f"forward's by {_relative(x, boundary[layers.stop - 1]):.2g} (relative): "
                        "its layers depend on more than the previous layer's hidden states.",
                        hint="Plan this model without pipeline parallelism (--pp 1).",
                    )
    finally:
        for module, training in modes.items():
            module.train(training)
    error = _relative(x, want)
    if x.shape != want.shape or error > split_tolerance(net):
        raise BadInputError(
            f"memplan cannot split {name} into pipeline stages: the last stage's logits "
            f"differ from its whole forward's by {error:.2g} (relative), though every stage "
            "boundary's hidden states are equal: its forward does more after the layers than "
            "the norm and head of its pipeline plan.",
            hint="Plan this model without pipeline parallelism (--pp 1).",
        )


def pipeline_refusal(net: torch.nn.Module) -> str | None:
    """Why memplan cannot run ``net`` under pipeline stages (the first line of the
    refusal ``pipeline_parts`` or ``check_pipeline_split`` raises), or None when it can.
    Parameters on the meta device: only the pipeline plan is checked."""
    from memplan.errors import first_line

    try:
        pipeline_parts(net)
        if next(net.parameters()).device.type != "meta":
            check_pipeline_split(net)
    except BadInputError as exc:
        return exc.message.strip().splitlines()[0]
    except Exception as exc:  # its forward would not run as the check calls it
        return (
            f"memplan could not check {type(net).__name__}'s pipeline split: its forward on "
            f"token ids raised {type(exc).__name__}: {first_line(exc)}"
        )
    return None
