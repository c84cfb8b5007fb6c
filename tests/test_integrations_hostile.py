"""What a hostile user found in the integrations (plan_trainer, MemplanBatchSize,
accelerator_kwargs/prepare_model): a DeepSpeed config left at the old batch, so that
``train()`` failed on DeepSpeed's mismatch; errors in the user's compute_loss,
training_step or dataset blamed on memplan's own wrappers; a GradientAccumulationScheduler
planned for the wrong effective batch; bad values reaching the user as raw Python
exceptions, or only inside ``trainer.fit``; a float8 plan's conversion silently dropped."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from integration_models import blocks_model, data, lightning_fit, mse, sgd, tiny_llama

import memplan
from memplan.errors import BadInputError, ModelFileError, NoPlanFitsError

HERE = str(Path(__file__).resolve())
MEMPLAN_SRC = str(Path(memplan.__file__).resolve().parent)


def _line_of_raise(fn):
    """The line of the first statement of ``fn``'s body (its ``raise``)."""
    return fn.__code__.co_firstlineno + 1


# ---------------------------------------------------------------------- Hugging Face
def _llama():
    return tiny_llama(pytest.importorskip("transformers"))


def _rows(n=16, token=None):
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = (
            torch.randint(0, 64, (12,), generator=g) if token is None else torch.full((12,), token)
        )
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _arguments(**extra):
    transformers = pytest.importorskip("transformers")
    return transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=8,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **extra,
    )


_DEEPSPEED_SCRIPT = """
import json, os, sys, tempfile
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
from memplan.model.loader import settle_torchvision
settle_torchvision()
import torch, transformers
from memplan.integrations.hf import plan_trainer

torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    max_position_embeddings=32)
rows = [{"input_ids": (ids := torch.randint(0, 64, (12,))), "labels": ids.clone()}
        for _ in range(16)]
ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "zero_optimization": {"stage": 2}}
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, use_cpu=True,
    report_to=[], save_strategy="no", disable_tqdm=True, deepspeed=ds_config)
trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(cfg), args=args,
                               train_dataset=rows)
plan_trainer(trainer, budget="1GiB", min_micro=2, max_micro=2, micro_batches=(1, 2),
             timing_rounds=1)
plan = trainer.memplan_plan
config = dict(trainer.accelerator.state.deepspeed_plugin.deepspeed_config)
out = {"plan": [plan.micro_batch_size, plan.accumulation_steps, plan.target_batch],
       "args": [args.per_device_train_batch_size, args.gradient_accumulation_steps],
       "config": [config[k] for k in ("train_micro_batch_size_per_gpu",
                  "gradient_accumulation_steps", "train_batch_size")]}
try:
    trainer.train()
    engine = trainer.model_wrapped
    out["steps"] = trainer.state.global_step
    out["engine"] = [engine.train_micro_batch_size_per_gpu(),
                     engine.gradient_accumulation_steps(), engine.train_batch_size()]
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(out))
"""


def test_deepspeed_config_takes_the_plans_batch_and_training_runs(tmp_path):
    """The Trainer's constructor had written 4 and 2 over the config's "auto"s, so
    propagate_args_to_deepspeed only recorded a mismatch and train() raised DeepSpeed's
    "Please correct the following DeepSpeed config values". Run in its own process: DeepSpeed
    starts a process group and accelerate keeps its plugin in a process-wide state."""
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    script = tmp_path / "ds_plan.py"
    script.write_text(_DEEPSPEED_SCRIPT)
    port = str(29500 + os.getpid() % 400)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), port],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(line[-1][len("RESULT ") :])
    assert out["plan"] == [2, 4, 8]  # min_micro=max_micro=2: 2 × 4 for the Trainer's 4 × 2
    assert out["args"] == [2, 4]
    assert out["config"] == [2, 4, 8], out  # was [4, 2, 8]
    assert "error" not in out, out["error"]
    assert out["steps"] == 2
    assert out["engine"] == [2, 4, 8]  # DeepSpeed trained at the planned micro-batch × accumulation


def test_an_error_in_a_trainer_subclass_names_the_users_file_and_line():
    transformers = pytest.importorskip("transformers")
    from memplan.integrations.hf import plan_trainer

    class MyTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            raise ValueError("bug in MyTrainer.compute_loss")

    trainer = MyTrainer(model=_llama(), args=_arguments(), train_dataset=_rows())
    with pytest.raises(ModelFileError) as raised:
        plan_trainer(trainer, budget="1GiB", micro_batches=(1, 2), timing_rounds=1)
    line = _line_of_raise(MyTrainer.compute_loss)
    # was ".../memplan/integrations/hf.py:165: compute_loss() raised ... Fix compute_loss()
    # in .../memplan/integrations/hf.py"
    assert raised.value.message.startswith(
        f"{HERE}:{line}: compute_loss() raised ValueError: bug in MyTrainer.compute_loss"
    )
    assert raised.value.hint == (
        f"Fix compute_loss() in {HERE}; memplan runs it as a training script would."
    )


class _BadRows(torch.utils.data.Dataset):
    """A dataset whose samples fail: the user's own ``__getitem__``."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        raise KeyError(f"row {index} is missing")


def test_an_error_in_the_users_dataset_or_data_names_the_users_code():
    transformers = pytest.importorskip("transformers")
    from memplan.integrations.hf import plan_trainer

    trainer = transformers.Trainer(model=_llama(), args=_arguments(), train_dataset=_BadRows())
    with pytest.raises(ModelFileError) as raised:
        plan_trainer(trainer, budget="1GiB", micro_batches=(1, 2), timing_rounds=1)
    line = _line_of_raise(_BadRows.__getitem__)
    assert raised.value.message.startswith(f"{HERE}:{line}: data_collator() raised KeyError")
    assert raised.value.hint.startswith(f"Fix data_collator() in {HERE};")

    # token ids past the vocabulary fail inside torch, under the Trainer's own compute_loss:
    # the script is named to fix, never memplan's wrapper or transformers' trainer.py
    trainer = transformers.Trainer(
        model=_llama(), args=_arguments(), train_dataset=_rows(token=500)
    )
    with pytest.raises(ModelFileError) as raised:
        plan_trainer(trainer, budget="1GiB", micro_batches=(1, 2), timing_rounds=1)
    assert "compute_loss() raised IndexError" in raised.value.message
    assert MEMPLAN_SRC not in raised.value.message
    assert raised.value.hint == (
        f"Fix compute_loss() in {HERE}; memplan runs it as a training script would."
    )


def test_a_streaming_dataset_asks_for_batch():
    transformers = pytest.importorskip("transformers")
    from memplan.integrations.hf import plan_trainer

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from _rows()

    trainer = transformers.Trainer(model=_llama(), args=_arguments(), train_dataset=Rows())
    with pytest.raises(BadInputError) as raised:  # was TypeError: ... has no len()
        plan_trainer(trainer, budget="1GiB", micro_batches=(1, 2))
    assert raised.value.message.startswith("The Trainer has a Rows as train_dataset, which")
    assert raised.value.hint == (
        "Pass batch= (a batch, or a function batch_size -> batch) to plan_trainer."
    )
    # with batch= it plans
    first = transformers.default_data_collator(_rows(4))
    plan_trainer(trainer, budget="1GiB", batch=dict(first), micro_batches=(1, 2), timing_rounds=1)
    assert trainer.memplan_plan.target_batch == 8


# ---------------------------------------------------------------------- Lightning
def _lightning():
    return pytest.importorskip("lightning.pytorch")


def _module_class(L):
    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = blocks_model()
            self.batch_size = 8

        def training_step(self, batch, batch_idx):
            return mse(self.net, batch)

        def configure_optimizers(self):
            return sgd(self.parameters())

        def train_dataloader(self):
            x, y = data(32)
            return torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(x, y), batch_size=self.batch_size
            )

    return Module


def _fit(L, module, callbacks):
    return lightning_fit(L, module, callbacks, 2)


def test_an_error_in_training_step_names_the_users_file_and_line():
    L = _lightning()
    from memplan.integrations.lightning import MemplanBatchSize

    class Buggy(_module_class(L)):
        def training_step(self, batch, batch_idx):
            raise ValueError("bug in my training_step")

    with pytest.raises(ModelFileError) as raised:
        _fit(L, Buggy(), [MemplanBatchSize("1GiB", micro_batches=(1, 2), timing_rounds=1)])
    line = _line_of_raise(Buggy.training_step)
    assert raised.value.message.startswith(  # was .../memplan/integrations/lightning.py:169
        f"{HERE}:{line}: training_step() raised ValueError: bug in my training_step"
    )
    assert raised.value.hint == (
        f"Fix training_step() in {HERE}; memplan runs it as a training script would."
    )


def test_an_error_in_the_dataloaders_dataset_names_the_users_file_and_line():
    L = _lightning()
    from memplan.integrations.lightning import MemplanBatchSize

    class BadData(_module_class(L)):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(_BadRows(), batch_size=self.batch_size)

    with pytest.raises(ModelFileError) as raised:
        _fit(L, BadData(), [MemplanBatchSize("1GiB", micro_batches=(1, 2), timing_rounds=1)])
    line = _line_of_raise(_BadRows.__getitem__)
    assert raised.value.message.startswith(f"{HERE}:{line}: collate_fn() raised KeyError")
    assert raised.value.hint.startswith(f"Fix collate_fn() in {HERE};")


def test_a_gradient_accumulation_scheduler_is_refused_before_planning():
    L = _lightning()
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from memplan.integrations.lightning import MemplanBatchSize

    module = _module_class(L)()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    planner = MemplanBatchSize("1GiB", micro_batches=(1, 2), timing_rounds=1)
    with pytest.raises(BadInputError) as raised:  # was Lightning's raw ValueError, after planning
        _fit(L, module, [GradientAccumulationScheduler({0: 4}), planner])
    assert "GradientAccumulationScheduler" in raised.value.message
    assert "sets accumulate_grad_batches itself" in raised.value.message
    assert raised.value.hint.startswith("Remove the GradientAccumulationScheduler callback")
    assert planner.plan is None  # refused before any planning
    assert module.batch_size == 8
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"budget": None}, "budget must be a size such as '24GiB'"),
        ({"budget": "nan"}, "budget 'nan' is not a size."),
        ({"budget": "-1GiB"}, "budget '-1GiB' is not a size."),
        ({"budget": 0}, "budget must be a positive whole number of bytes, got 0."),
        ({"budget": "150%"}, "budget '150%': a percentage must be in (0, 100]."),
        ({"budget": "1GiB", "target_batch": 0}, "target_batch must be a positive whole number"),
        ({"budget": "1GiB", "target_batch": -3.5}, "got -3.5."),
        ({"budget": "1GiB", "target_batch": True}, "got True."),
        ({"budget": "1GiB", "batch_arg_name": 8}, "batch_arg_name must be the name of"),
    ],
)
def test_bad_values_are_refused_when_the_callback_is_made(kwargs, said):
    _lightning()
    from memplan.integrations.lightning import MemplanBatchSize

    with pytest.raises(BadInputError) as raised:  # was: accepted, failing inside trainer.fit
        MemplanBatchSize(**kwargs)
    assert said in raised.value.message


def test_good_values_are_accepted_when_the_callback_is_made():
    _lightning()
    from memplan.integrations.lightning import MemplanBatchSize

    for budget in ("80%", "auto", "24GiB", 2**30):
        assert MemplanBatchSize(budget, target_batch=64).budget == budget


# ---------------------------------------------------------------------- Accelerate
def test_accelerate_helpers_refuse_what_is_not_a_plan():
    from memplan.integrations.accelerate import accelerator_kwargs, prepare_model

    with pytest.raises(BadInputError) as raised:  # was AttributeError on 'NoneType'
        accelerator_kwargs(None)
    assert raised.value.message == "accelerator_kwargs() takes a memplan Plan, got NoneType."
    with pytest.raises(BadInputError, match=r"prepare_model\(\) takes a memplan Plan, got dict"):
        prepare_model(torch.nn.Linear(2, 2), {"micro_batch_size": 2})


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
            for _ in range(2)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


def _float8_plan():
    """A float8 plan as plan_model makes it: FSDP2 over 2 ranks, tensorwise, weights
    all-gathered in float8."""
    pytest.importorskip("torchao")
    return memplan.plan_model(
        _Net(),
        torch.randn(16, 64),
        budget="1GiB",
        target_batch=16,
        precision="float8",
        strategy="fsdp",
        world_size=2,
        micro_batches=(1, 2),
        timing_rounds=1,
    )


def test_a_float8_plan_converts_the_linears_it_was_measured_with():
    import dataclasses

    from memplan.integrations.accelerate import accelerator_kwargs, prepare_model

    plan = _float8_plan()
    # as `memplan probe --no-float8-all-gather` makes it: runnable on the CPU (gloo)
    plan = dataclasses.replace(
        plan, float8=dataclasses.replace(plan.float8, fsdp_float8_all_gather=False)
    )
    assert plan.float8.converted == 4
    assert accelerator_kwargs(plan)["mixed_precision"] == "bf16"  # the rest of the step
    model = prepare_model(_Net(), plan)
    kinds = [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert kinds.count("Float8Linear") == plan.float8.converted  # was 0: nothing converted
    prepare_model(model, plan)  # a second call converts nothing twice
    assert [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)] == kinds


def test_a_float8_all_gather_plan_is_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("the refusal is for a machine without CUDA")
    from memplan.integrations.accelerate import prepare_model

    plan = _float8_plan()
    assert plan.float8.fsdp_float8_all_gather
    with pytest.raises(BadInputError, match="all-gathers in float8") as raised:
        prepare_model(_Net(), plan)
    assert raised.value.hint.startswith("Train this plan on CUDA GPUs")


# ------------------------------------------------------------- the script's own words
def test_errors_from_plan_model_name_its_keywords_not_the_clis_flags():
    """The probe says 'choose others with --layers GLOB'; a script has no --layers. Before,
    plan_model(layers='nomatch*') said "--layers 'nomatch*' matches no module"."""
    with pytest.raises(BadInputError) as raised:
        memplan.plan_model(
            blocks_model(), data(8), budget="1GiB", target_batch=8, loss_fn=mse, layers="nomatch*"
        )
    assert raised.value.message.startswith("layers='nomatch*' matches no module of the model.")
    assert "--" not in str(raised.value)


def test_a_no_fit_hint_from_plan_model_names_keywords():
    """The solver's hint names flags for the command (--margin, --layers, --max-micro):
    from plan_model it names the keyword arguments, and nothing with a leading --."""
    with pytest.raises(NoPlanFitsError) as raised:
        memplan.plan_model(blocks_model(), data(8), budget=890_000, target_batch=8, loss_fn=mse)
    said = str(raised.value)
    assert "only the 3% safety margin rules it out; margin=0 (or margin=0.0" in said, said
    assert "--" not in said, said


def test_a_sequence_length_for_a_batch_of_tensors_asks_for_a_batch_function():
    """Before: 'make_batch(batch_size) takes no sequence length … Define make_batch(…) in
    <the script>', for a script that passed tensors and has no make_batch."""
    with pytest.raises(ModelFileError) as raised:
        memplan.plan_model(
            blocks_model(), data(8), budget="1GiB", target_batch=8, loss_fn=mse, seq_len=64
        )
    assert "the batch is tensors of their own length" in raised.value.message
    assert raised.value.hint.startswith("Pass a function batch_fn(batch_size, seq_len)")
    assert "make_batch" not in str(raised.value)


@pytest.mark.parametrize(
    "text, said",
    [
        ("Choose other layers with --layers GLOB.", "Choose other layers with layers=GLOB."),
        ("--layers 'blocks.*' matches nothing", "layers='blocks.*' matches nothing"),
        ("or try --margin 0.", "or try margin=0."),
        ("Plan at --budget 24GiB.", "Plan at budget='24GiB'."),
        ("add --compiled, or see --debug", "add compiled=True, or see --debug"),
        ("Give --tp 2.", "Give layout=LayoutRequest(tp=2)."),
        ("--no-sequence-parallel", "layout=LayoutRequest(sequence_parallel=False)"),
        ("--seq-len max", "seq_len max"),
        ("--format hf", "formats hf"),
        ("a--layers b", "a--layers b"),
    ],
)
def test_flags_read_as_plan_models_keywords(text, said):
    from memplan.integrations import api, terms

    keywords, switches = terms.keywords_of(api.plan_model.__wrapped__, api.request_parameters)
    assert terms.script_terms(text, keywords, switches) == said


@pytest.mark.parametrize(
    "batch, said",
    [
        ((), "got an empty tuple."),
        ({}, "got an empty dict."),
        (None, "got None."),
        (torch.zeros(0, 8), "got a Tensor with 0 samples (first dimension 0: (0, 8))."),
        (torch.tensor(1.0), "got a 0-dimensional tensor, which has no samples."),
        (("text",), "got a tuple that holds no tensor."),
    ],
)
def test_a_batch_with_no_samples_says_what_it_is(batch, said):
    """Before, an empty tuple read 'got tuple', as if tuples were refused."""
    with pytest.raises(BadInputError) as raised:
        memplan.plan_model(blocks_model(), batch, budget="1GiB", target_batch=8, loss_fn=mse)
    assert raised.value.message.endswith(said), raised.value.message


def test_a_batch_given_as_data_is_not_called_make_batch():
    """A batch of tensors is the script's data, not a make_batch function's return: before,
    a non-tensor item read 'make_batch(1) returned a batch whose batch[1] is not a tensor'."""
    x, _ = data(8)
    with pytest.raises(ModelFileError) as raised:
        memplan.plan_model(blocks_model(), (x, 3), budget="1GiB", target_batch=8, loss_fn=mse)
    assert ": the batch's batch[1] is not a tensor; it must be a tensor" in raised.value.message
    assert "make_batch" not in str(raised.value)
