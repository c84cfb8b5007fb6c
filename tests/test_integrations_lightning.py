"""memplan.integrations.lightning.MemplanBatchSize on a real Lightning Trainer (issue 32):
the callback sets the batch size where BatchSizeFinder finds it (the module or the
datamodule), accumulate_grad_batches and the checkpointed layers before fitting, and the
run trains to the same weights as the full batch without memplan, within the budget."""

import pytest
import torch
from integration_models import (
    TARGET,
    blocks_model,
    data,
    lightning_fit,
    max_difference,
    mse,
    sgd,
    tightest_budget,
)

L = pytest.importorskip("lightning.pytorch")

import memplan  # noqa: E402
from memplan.errors import BadInputError, NoPlanFitsError  # noqa: E402
from memplan.integrations.lightning import MemplanBatchSize  # noqa: E402
from memplan.probe.tracker import LiveTracker, resident_tensors  # noqa: E402

STEPS = 3


class Module(L.LightningModule):
    def __init__(self, batch_size=TARGET):
        super().__init__()
        self.net = blocks_model()
        self.batch_size = batch_size

    def training_step(self, batch, batch_idx):
        loss = mse(self.net, batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return sgd(self.parameters())

    def train_dataloader(self):
        x, y = data(TARGET * STEPS)
        dataset = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size)


class Data(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.batch_size = TARGET

    def train_dataloader(self):
        x, y = data(TARGET * STEPS)
        dataset = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size)


class PeakDuringTraining(L.Callback):
    """memplan's live-tensor tracker from the first training batch to the end of fit."""

    def on_train_start(self, trainer, pl_module):
        self.tracker = LiveTracker(record=False)
        self.tracker.track(resident_tensors(pl_module, trainer.optimizers[0], None))
        self.tracker.__enter__()

    def on_train_end(self, trainer, pl_module):
        self.tracker.__exit__(None, None, None)


def fit(module, callbacks, datamodule=None):
    return lightning_fit(L, module, callbacks, STEPS, datamodule)


@pytest.fixture(scope="module")
def reference():
    module = Module()
    fit(module, [])
    return module


@pytest.mark.parametrize("on_datamodule", [False, True])
def test_the_callback_trains_like_the_full_batch_within_the_budget(reference, on_datamodule):
    module = Module()
    datamodule = Data() if on_datamodule else None
    if on_datamodule:
        del module.batch_size  # found on the datamodule, as BatchSizeFinder finds it
    planner = MemplanBatchSize("64MiB", min_micro=8, max_micro=8, micro_batches=(1, 2))
    peak = PeakDuringTraining()
    trainer = fit(module, [planner, peak], datamodule)
    plan = planner.plan
    assert (plan.micro_batch_size, plan.accumulation_steps) == (8, 4)
    holder = datamodule if on_datamodule else module
    assert holder.batch_size == 8 and trainer.accumulate_grad_batches == 4
    assert trainer.global_step == STEPS
    assert memplan.run.checkpointed_names(module) == list(plan.checkpoint)
    assert peak.tracker.peak_bytes <= tightest_budget(plan)
    assert max_difference(module, reference) < 1e-12


def test_checkpointed_layers_are_applied_to_the_module(reference):
    module = Module()
    planner = MemplanBatchSize(
        "64MiB",
        max_micro=8,
        micro_batches=(1, 2),
        always_checkpoint=("net.blocks.1",),
        modes="keep,full",
    )
    fit(module, [planner])
    assert planner.plan.checkpoint == {"net.blocks.1": "full"}
    assert memplan.run.checkpointed_names(module) == ["net.blocks.1"]
    assert max_difference(module, reference) < 1e-12


def test_a_misspelled_option_fails_when_the_callback_is_made():
    # not at on_fit_start, after the Trainer has started
    with pytest.raises(TypeError, match=r"MemplanBatchSize\(\) .* 'stratgy' \(did you mean"):
        MemplanBatchSize("1GiB", stratgy="fsdp")
    assert MemplanBatchSize("1GiB", precision="bf16", micro_batches=(1, 2)).request == {
        "precision": "bf16",
        "micro_batches": (1, 2),
    }


def test_a_budget_no_plan_fits_stops_before_the_first_step():
    module = Module()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    planner = MemplanBatchSize("16KiB", micro_batches=(1, 2))
    with pytest.raises(NoPlanFitsError):
        fit(module, [planner])
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_no_batch_size_attribute_is_a_clear_error():
    module = Module()
    del module.batch_size
    with pytest.raises(BadInputError, match="Field batch_size not found"):
        fit(module, [MemplanBatchSize("64MiB")])


def test_a_training_step_without_a_loss_is_named_as_lightning_names_it():
    # The error named training_loss(model, batch), which a LightningModule does not define.
    from memplan.errors import ModelFileError

    class NoLoss(Module):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(ModelFileError, match=r"training_step\(model, batch\) is NoneType"):
        fit(NoLoss(), [MemplanBatchSize("64MiB", micro_batches=(1, 2))])
