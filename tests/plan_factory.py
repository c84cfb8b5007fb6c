"""Plans built by hand for tests that need a plan file and no solve."""

from collections.abc import Iterable

from memplan.plan import Breakdown, Plan, Prediction


def hand_plan(
    model: str,
    *,
    micro: int = 1,
    k: int = 4,
    peak: int = 10**6,
    budget: int = 10**9,
    full: Iterable[str] = (),
    **extra,
) -> Plan:
    """A plan of ``micro`` × ``k`` samples a data-parallel rank (the target batch follows the
    layout's ``dp``, else ``world_size``; ``world_size`` follows ``parallel`` when not
    given), the ``full`` layers fully checkpointed, the rest of Plan's fields in ``extra``."""
    layout = extra.get("parallel")
    if layout is not None:
        extra.setdefault("world_size", layout.world_size)
    dp = extra.get("world_size", 1) if layout is None else layout.dp
    return Plan(
        target_batch=micro * k * dp,
        micro_batch_size=micro,
        accumulation_steps=k,
        checkpoint=dict.fromkeys(full, "full"),
        budget_bytes=budget,
        predicted=Prediction(
            peak_bytes=peak,
            step_seconds=0.01,
            breakdown=Breakdown(
                params=peak, grads=0, optimizer=0, activations=0, transient=0, reserve=0
            ),
        ),
        model=model,
        **extra,
    )


def independent_peak(model: str, plan: Plan) -> int:
    """The peak of the plan run by ``measure_training_peak`` on cpu (its micro-batch,
    accumulation and modes), apart from ``verify``: the check that a prediction holds."""
    from memplan.probe import measure_training_peak

    return measure_training_peak(
        model,
        device="cpu",
        micro_batch=plan.micro_batch_size,
        accumulation_steps=plan.accumulation_steps,
        checkpoint_modes=plan.checkpoint,
    ).peak_bytes
