"""memplan.integrations.hf.plan_trainer on the real Hugging Face Trainer (issue 32): a tiny
Llama in float64 trains with the plan's per-device batch, accumulation and checkpointing to
the same weights as the Trainer without memplan at the same effective batch, within the
budget; a Trainer subclass (TRL style) keeps its own loss; a budget no plan fits stops
before training."""

import tempfile

import pytest
import torch
from integration_models import (
    max_difference,
    state_digest,
    tightest_budget,
    tiny_llama,
    tracked_peak,
)

transformers = pytest.importorskip("transformers")

import memplan  # noqa: E402
from memplan.errors import NoPlanFitsError  # noqa: E402
from memplan.integrations.hf import configure_trainer, plan_trainer, trainer_request  # noqa: E402

TARGET, STEPS, SEQ = 8, 2, 12


def llama():
    return tiny_llama(transformers).double()


def dataset():
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(TARGET * STEPS):
        ids = torch.randint(0, 64, (SEQ,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def arguments(**extra):
    return transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=TARGET,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=1e-2,
        optim="sgd",  # linear in the gradients: rounding stays rounding (integration_models.sgd)
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        disable_tqdm=True,
        **extra,
    )


class MetricsTrainer(transformers.Trainer):
    """A TRL-style subclass (SFTTrainer's shape): its own compute_loss, which calls the
    Trainer's and records a metric of its own."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, out = super().compute_loss(model, inputs, True, num_items_in_batch)
        self.tokens_seen = getattr(self, "tokens_seen", 0) + int(inputs["input_ids"].numel())
        return (loss, out) if return_outputs else loss


@pytest.fixture(scope="module")
def reference():
    model = llama()
    transformers.Trainer(model=model, args=arguments(), train_dataset=dataset()).train()
    return model


@pytest.mark.parametrize(
    ("trainer_class", "request_", "whole"),
    [
        (
            transformers.Trainer,
            {"always_checkpoint": ("model.layers.0",), "never_checkpoint": ("model.layers.1",)},
            False,
        ),
        (MetricsTrainer, {"always_checkpoint": ("model.layers.*",)}, True),
    ],
)
def test_plan_trainer_trains_like_the_full_batch(reference, trainer_class, request_, whole):
    model = llama()
    trainer = trainer_class(model=model, args=arguments(), train_dataset=dataset())
    before = state_digest(model)
    plan_trainer(
        trainer,
        budget="1GiB",
        min_micro=2,
        max_micro=2,
        modes="keep,full",
        micro_batches=(1, 2),
        **request_,
    )
    assert state_digest(model) == before  # planning touched nothing
    plan = trainer.memplan_plan
    args = trainer.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert args.train_batch_size * args.gradient_accumulation_steps * args.world_size == TARGET
    assert args.gradient_checkpointing is whole
    assert memplan.run.checkpointed_names(model) == ([] if whole else ["model.layers.0"])
    peak = tracked_peak(trainer.train, model)
    assert trainer.state.global_step == STEPS
    assert peak <= tightest_budget(plan)
    if whole:
        assert model.is_activation_checkpointing
    assert max_difference(model, reference) < 1e-10


def test_a_budget_no_plan_fits_stops_before_training():
    trainer = transformers.Trainer(model=llama(), args=arguments(), train_dataset=dataset())
    with pytest.raises(NoPlanFitsError, match=r"fits 32\.0 KiB"):
        plan_trainer(trainer, budget="32KiB", micro_batches=(1, 2))
    assert trainer.args.per_device_train_batch_size == TARGET
    assert trainer.state.global_step == 0


def test_a_misspelled_option_is_refused_before_anything_runs():
    trainer = transformers.Trainer(model=llama(), args=arguments(), train_dataset=dataset())
    with pytest.raises(TypeError, match=r"plan_trainer\(\) .* 'precison' \(did you mean"):
        plan_trainer(trainer, budget="1GiB", precison="bf16")
    assert trainer.args.per_device_train_batch_size == TARGET


def test_deepspeed_and_fsdp_settings_are_kept():
    """The engine already in TrainingArguments picks the strategy and stays as it was."""
    from types import SimpleNamespace

    from memplan.integrations.api import solve_profile  # noqa: F401 - the same request

    args = SimpleNamespace(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        world_size=1,
        train_batch_size=4,
        bf16=True,
        fsdp="full_shard auto_wrap",
        fsdp_config={"version": 2},
        gradient_checkpointing=True,
    )
    trainer = SimpleNamespace(args=args, is_fsdp_enabled=True, model=torch.nn.Linear(2, 2))
    assert trainer_request(trainer) == {"precision": "bf16", "world_size": 1, "strategy": "fsdp"}
    plan = memplan.Plan(
        target_batch=8,
        micro_batch_size=1,
        accumulation_steps=8,
        budget_bytes=10**6,
        predicted=_prediction(),
        model="x.py",
        strategy="fsdp",
    )
    configure_trainer(trainer, plan)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 8)
    assert args.fsdp == "full_shard auto_wrap" and args.fsdp_config == {"version": 2}
    assert args.gradient_checkpointing is False and trainer._train_batch_size == 4


def _prediction():
    from memplan.plan import Breakdown, Prediction

    zero = Breakdown(params=0, grads=0, optimizer=0, activations=0, transient=0, reserve=0)
    return Prediction(peak_bytes=0, step_seconds=0.0, breakdown=zero)


def test_a_broken_collator_or_loss_is_named_as_the_trainer_names_it():
    # The errors named make_batch() and training_loss(model, batch), which no Trainer has.
    from memplan.errors import ModelFileError

    trainer = transformers.Trainer(
        model=llama(), args=arguments(), train_dataset=dataset(), data_collator=lambda rows: None
    )
    with pytest.raises(ModelFileError, match=r"data_collator\(1\) returned NoneType") as raised:
        plan_trainer(trainer, budget="1GiB", micro_batches=(1, 2))
    assert "make_batch" not in str(raised.value)

    class NoLoss(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 0

    trainer = NoLoss(model=llama(), args=arguments(), train_dataset=dataset())
    with pytest.raises(ModelFileError, match=r"compute_loss\(model, batch\) is int") as raised:
        plan_trainer(trainer, budget="1GiB", micro_batches=(1, 2))
    assert raised.value.hint == "Make compute_loss(model, batch) return a scalar loss tensor."
