"""Plans built by hand for tests that need a plan file and no solve."""

from memplan.plan import Breakdown, Plan, Prediction


def hand_plan(model: str, *, micro: int = 1, k: int = 4, peak: int = 10**6, **extra) -> Plan:
    return Plan(
        target_batch=micro * k,
        micro_batch_size=micro,
        accumulation_steps=k,
        budget_bytes=10**9,
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
