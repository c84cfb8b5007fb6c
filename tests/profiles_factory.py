"""Hand-made Profiles for tests: no torch, no probe, every number known.

Two builders:

* :class:`ChainSpec` — a chain model (embedding → n layers → head and loss) described by
  per-sample byte sizes, whose ``profile()`` writes the timeline the probe would record,
  and whose ``simulate_peak_bytes`` walks the same model *with* a given checkpoint set, an
  oracle independent of the savings algebra in memplan.memory.
* :func:`raw_profile` — arbitrary segments and savings (need not be physical), for the
  solver's brute-force comparisons.

Import from a test as ``from profiles_factory import ChainSpec, raw_profile`` (pytest puts
``tests/`` on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from memplan.profile import (
    Affine,
    Environment,
    FixedPart,
    Layer,
    ModelRef,
    Point,
    Profile,
    Segment,
    Totals,
)


def per_sample(slope: float, intercept: float = 0.0) -> Affine:
    return Affine(intercept=float(intercept), slope=float(slope))


def _environment(device: str = "cpu", **kwargs) -> Environment:
    name = {"cpu": "cpu", "cuda": "NVIDIA Test GPU", "meta": "meta"}[device]
    return Environment(
        torch_version="test",
        memplan_version="test",
        device=device,
        device_name=kwargs.pop("device_name", name),
        **kwargs,
    )


# --------------------------------------------------------------------------- chain model
@dataclass(frozen=True, kw_only=True)
class ChainSpec:
    """A chain of layers with per-sample activation sizes (bytes per sample).

    Layer i saves ``saved[i]·b`` bytes for backward (its output ``output[i]·b`` included),
    so checkpointing it frees ``(saved[i] − output[i])·b`` while it is held. Its forward
    briefly needs ``fwd_transient[i]·b`` more; its backward ``bwd_transient[i]·b`` more
    plus its new gradient; a checkpointed backward ``recompute_transient[i]·b`` more (by
    default what the recompute brings back plus the backward transient)."""

    params: Sequence[int] = (1000, 1000, 1000, 1000)
    """Trainable parameter bytes per layer (gradients: the same, AdamW state: twice)."""
    saved: Sequence[float] = (100, 100, 100, 100)
    output: Sequence[float] = (10, 10, 10, 10)
    fwd_transient: Sequence[float] | None = None
    bwd_transient: Sequence[float] | None = None
    recompute_transient: Sequence[float] | None = None
    fwd_seconds: Sequence[float] = (0.25, 0.25, 0.25, 0.25)
    """Seconds per sample of each layer's forward (backward: twice)."""
    embed_params: int = 500
    embed_saved: float = 8
    head_params: int = 500
    head_saved: float = 20
    loss_transient: float = 30
    optimizer_transient: int = 0
    """Bytes the optimizer step needs above params, grads and state."""
    fixed_seconds: float = 0.125
    optimizer_seconds: float = 0.5
    names: Sequence[str] | None = None
    device: str = "cpu"
    micro_batches: tuple[int, ...] = (1, 2, 4)
    layer_has_batchnorm: Sequence[bool] | None = None
    profile_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.params)
        for name in ("saved", "output", "fwd_seconds"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} must have {n} entries")

    # sizes ---------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.params)

    def layer_names(self) -> list[str]:
        return list(self.names) if self.names is not None else [f"h.{i}" for i in range(self.n)]

    def _fwd_tr(self, i: int) -> float:
        return self.fwd_transient[i] if self.fwd_transient is not None else self.output[i]

    def _bwd_tr(self, i: int) -> float:
        return self.bwd_transient[i] if self.bwd_transient is not None else 2 * self.output[i]

    def _rec_tr(self, i: int) -> float:
        if self.recompute_transient is not None:
            return self.recompute_transient[i]
        return (self.saved[i] - self.output[i]) + self._bwd_tr(i)

    def savings_per_sample(self, i: int) -> float:
        return self.saved[i] - self.output[i]

    def params_bytes(self) -> int:
        return sum(self.params) + self.embed_params + self.head_params

    def state_bytes(self, grads_resident: bool) -> int:
        """Params + AdamW state (+ all gradients when resident)."""
        p = self.params_bytes()
        return p + 2 * p + (p if grads_resident else 0)

    # the timeline the probe would record ------------------------------------
    def _segments(self, grads_resident: bool) -> tuple[Segment, ...]:
        """Live bytes per sample are affine with intercept = resident state; each point is
        written as (intercept, slope)."""
        n = self.n
        base = self.state_bytes(grads_resident)
        grads = 0 if grads_resident else None  # None: gradients counted as they appear

        def pt(fixed: float, slope: float) -> tuple[Point, ...]:
            return ((float(fixed), float(slope)),)

        segs: list[Segment] = []
        level = self.embed_saved
        segs.append(Segment(held=0, active="none", points=pt(base, level)))
        for i in range(n):
            segs.append(
                Segment(
                    held=i,
                    active="fwd",
                    points=pt(base, level + self.saved[i] + self._fwd_tr(i)),
                    ckpt_points=pt(base, level + self.output[i] + self._fwd_tr(i)),
                )
            )
            level += self.saved[i]
            segs.append(Segment(held=i + 1, active="none", points=pt(base, level)))
        segs.append(
            Segment(
                held=n,
                active="none",
                points=pt(base, level + self.head_saved + self.loss_transient),
            )
        )
        level += self.head_saved
        new_grads = 0
        # head backward: logits gradient, head's gradient appears
        head_grad = self.head_params if grads is None else 0
        segs.append(
            Segment(held=n, active="none", points=pt(base + head_grad, level + self.loss_transient))
        )
        new_grads += head_grad
        level -= self.head_saved
        for i in range(n - 1, -1, -1):
            g = self.params[i] if grads is None else 0
            segs.append(
                Segment(
                    held=i,
                    active="bwd",
                    points=pt(base + new_grads + g, level + self._bwd_tr(i)),
                    ckpt_points=pt(
                        base + new_grads + g, level - self.savings_per_sample(i) + self._rec_tr(i)
                    ),
                )
            )
            new_grads += g
            level -= self.saved[i]
            segs.append(Segment(held=i, active="none", points=pt(base + new_grads, level)))
        embed_grad = self.embed_params if grads is None else 0
        segs.append(Segment(held=0, active="none", points=pt(base + new_grads + embed_grad, level)))
        return tuple(segs)

    def optimizer_peak(self) -> int:
        return self.state_bytes(grads_resident=True) + self.optimizer_transient

    def profile(self) -> Profile:
        names = self.layer_names()
        bn = self.layer_has_batchnorm or [False] * self.n
        layers = []
        for i in range(self.n):
            prev_out = self.output[i - 1] if i else self.embed_saved
            layers.append(
                Layer(
                    name=names[i],
                    module_type="Block",
                    params_trainable_bytes=self.params[i],
                    params_frozen_bytes=0,
                    grad_bytes=self.params[i],
                    optimizer_state_bytes=2 * self.params[i],
                    input_bytes=per_sample(prev_out),
                    output_bytes=per_sample(self.output[i]),
                    saved_bytes=per_sample(self.saved[i]),
                    savings_bytes=per_sample(self.savings_per_sample(i)),
                    fwd_transient_bytes=per_sample(self._fwd_tr(i)),
                    bwd_transient_bytes=per_sample(self._bwd_tr(i)),
                    recompute_transient_bytes=per_sample(self._rec_tr(i)),
                    fwd_seconds=per_sample(self.fwd_seconds[i]),
                    bwd_seconds=per_sample(2 * self.fwd_seconds[i]),
                    fwd_flops=per_sample(1e9 * self.fwd_seconds[i]),
                    has_batchnorm=bn[i],
                )
            )
        fixed = (
            FixedPart(
                name="embed",
                module_type="Embedding",
                params_trainable_bytes=self.embed_params,
                params_frozen_bytes=0,
                grad_bytes=self.embed_params,
                optimizer_state_bytes=2 * self.embed_params,
                saved_bytes=per_sample(self.embed_saved),
                fwd_seconds=Affine.constant(self.fixed_seconds / 6),
                bwd_seconds=Affine.constant(self.fixed_seconds / 6),
                fwd_flops=Affine.zero(),
            ),
            FixedPart(
                name="head",
                module_type="Linear",
                params_trainable_bytes=self.head_params,
                params_frozen_bytes=0,
                grad_bytes=self.head_params,
                optimizer_state_bytes=2 * self.head_params,
                saved_bytes=per_sample(self.head_saved),
                fwd_seconds=Affine.constant(self.fixed_seconds / 3),
                bwd_seconds=Affine.constant(self.fixed_seconds / 3),
                fwd_flops=Affine.zero(),
            ),
        )
        p = self.params_bytes()
        kwargs = {
            "model": ModelRef(path="synthetic.py"),
            "environment": _environment(self.device),
            "micro_batches": self.micro_batches,
            "totals": Totals(
                params_trainable_bytes=p,
                params_frozen_bytes=0,
                buffer_bytes=0,
                grad_bytes=p,
                optimizer_state_bytes=2 * p,
            ),
            "layers": tuple(layers),
            "fixed": fixed,
            "timeline": {"no_grads": self._segments(False), "grads_resident": self._segments(True)},
            "optimizer_step_peak_bytes": Affine.constant(self.optimizer_peak()),
            "optimizer_step_seconds": Affine.constant(self.optimizer_seconds),
            "step_fixed_seconds": Affine.constant(self.fixed_seconds),
            "has_batchnorm": any(bn),
        }
        kwargs.update(self.profile_kwargs)
        return Profile(**kwargs)

    # an independent oracle ---------------------------------------------------
    def simulate_micro_step_bytes(
        self, b: int, checkpointed: Iterable[int], grads_resident: bool
    ) -> int:
        """Walk one micro-step with ``checkpointed`` applied directly: a checkpointed
        layer keeps only its output in forward and recomputes in backward."""
        ckpt = set(checkpointed)
        live = self.state_bytes(grads_resident) + self.embed_saved * b
        peak = live
        kept = []
        for i in range(self.n):
            keep = (self.output[i] if i in ckpt else self.saved[i]) * b
            peak = max(peak, live + keep + self._fwd_tr(i) * b)
            live += keep
            kept.append(keep)
        peak = max(peak, live + (self.head_saved + self.loss_transient) * b)
        live += self.head_saved * b
        if not grads_resident:
            live += self.head_params
        peak = max(peak, live + self.loss_transient * b)
        live -= self.head_saved * b
        for i in range(self.n - 1, -1, -1):
            new_grad = 0 if grads_resident else self.params[i]
            extra = self._rec_tr(i) if i in ckpt else self._bwd_tr(i)
            peak = max(peak, live + new_grad + extra * b)
            live += new_grad - kept[i]
        if not grads_resident:
            live += self.embed_params
        return int(max(peak, live))

    def simulate_peak_bytes(
        self, b: int, checkpointed: Iterable[int], accumulation_steps: int
    ) -> int:
        ckpt = list(checkpointed)
        peak = max(self.optimizer_peak(), self.simulate_micro_step_bytes(b, ckpt, False))
        if accumulation_steps >= 2:
            peak = max(peak, self.simulate_micro_step_bytes(b, ckpt, True))
        return peak


def chain_profile(**kwargs) -> Profile:
    """``ChainSpec(**kwargs).profile()``."""
    return ChainSpec(**kwargs).profile()


def uniform_chain(n_layers: int, **kwargs) -> ChainSpec:
    """``n_layers`` identical blocks (a transformer-like stack)."""
    defaults = {
        "params": [1000] * n_layers,
        "saved": [100] * n_layers,
        "output": [10] * n_layers,
        "fwd_seconds": [0.25] * n_layers,
    }
    defaults.update(kwargs)
    return ChainSpec(**defaults)


# --------------------------------------------------------------------------- raw profiles
def raw_profile(
    *,
    savings: Sequence[Affine | float],
    fwd_seconds: Sequence[Affine | float],
    timeline: dict[str, Sequence[Segment]],
    optimizer_peak: Affine | float,
    bwd_seconds: Sequence[Affine | float] | None = None,
    step_fixed_seconds: Affine | float = 0.0,
    optimizer_seconds: Affine | float = 0.0,
    params_bytes: int = 0,
    grad_bytes: int = 0,
    optimizer_state_bytes: int = 0,
    names: Sequence[str] | None = None,
    device: str = "cpu",
    has_batchnorm: bool = False,
    **profile_kwargs,
) -> Profile:
    """A Profile from raw savings, times and segments (any numbers; floats mean per-sample
    slopes with zero intercept, an Affine is used as is)."""

    def aff(value: Affine | float) -> Affine:
        return value if isinstance(value, Affine) else per_sample(value)

    n = len(savings)
    names = list(names) if names is not None else [f"layer.{i}" for i in range(n)]
    bwd = bwd_seconds if bwd_seconds is not None else [0.0] * n
    layers = tuple(
        Layer(
            name=names[i],
            module_type="Block",
            params_trainable_bytes=0,
            params_frozen_bytes=0,
            grad_bytes=0,
            optimizer_state_bytes=0,
            input_bytes=Affine.zero(),
            output_bytes=Affine.zero(),
            saved_bytes=aff(savings[i]),
            savings_bytes=aff(savings[i]),
            fwd_transient_bytes=Affine.zero(),
            bwd_transient_bytes=Affine.zero(),
            recompute_transient_bytes=Affine.zero(),
            fwd_seconds=aff(fwd_seconds[i]),
            bwd_seconds=aff(bwd[i]),
            fwd_flops=Affine.zero(),
        )
        for i in range(n)
    )
    opt = optimizer_peak if isinstance(optimizer_peak, Affine) else Affine.constant(optimizer_peak)
    fixed_s = (
        step_fixed_seconds
        if isinstance(step_fixed_seconds, Affine)
        else Affine.constant(step_fixed_seconds)
    )
    opt_s = (
        optimizer_seconds
        if isinstance(optimizer_seconds, Affine)
        else Affine.constant(optimizer_seconds)
    )
    kwargs = {
        "model": ModelRef(path="raw.py"),
        "environment": _environment(device),
        "micro_batches": (1, 2),
        "totals": Totals(
            params_trainable_bytes=params_bytes,
            params_frozen_bytes=0,
            buffer_bytes=0,
            grad_bytes=grad_bytes,
            optimizer_state_bytes=optimizer_state_bytes,
        ),
        "layers": layers,
        "fixed": (),
        "timeline": {phase: tuple(segs) for phase, segs in timeline.items()},
        "optimizer_step_peak_bytes": opt,
        "optimizer_step_seconds": opt_s,
        "step_fixed_seconds": fixed_s,
        "has_batchnorm": has_batchnorm,
    }
    kwargs.update(profile_kwargs)
    return Profile(**kwargs)


def with_loss_part(profile: Profile, logits_per_sample: float) -> Profile:
    """``profile`` with a ``(loss)`` fixed part that frees ``logits_per_sample`` bytes per
    sample (negative saved bytes): the logits a pipeline's last stage would keep as its
    output (memory.pipeline.stage_output_bytes)."""
    import dataclasses

    loss = FixedPart(
        name="(loss)",
        module_type="loss",
        params_trainable_bytes=0,
        params_frozen_bytes=0,
        grad_bytes=0,
        optimizer_state_bytes=0,
        saved_bytes=Affine(intercept=0.0, slope=-logits_per_sample),
        fwd_seconds=Affine.zero(),
        bwd_seconds=Affine.zero(),
        fwd_flops=Affine.zero(),
    )
    return dataclasses.replace(profile, fixed=(*profile.fixed, loss))


def with_tp_measurement(profile: Profile, fraction: float, *, hf_blocks: bool = False) -> Profile:
    """``profile`` as if probed with a TP measurement: every block keeps ``fraction`` of its
    saved bytes under TP and splits all its trainable parameters; ``hf_blocks``: its blocks
    named as a transformers decoder's, which memplan can split into pipeline stages."""
    import dataclasses

    layers = tuple(
        dataclasses.replace(
            layer, tp_saved_fraction=fraction, tp_sharded_bytes=layer.params_trainable_bytes
        )
        for layer in profile.layers
    )
    hf = profile.layer_names if hf_blocks else profile.hf_blocks
    return dataclasses.replace(profile, layers=layers, hf_blocks=hf)
