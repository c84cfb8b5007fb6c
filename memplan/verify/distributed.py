"""Run a plan on N real ``torch.distributed`` processes and measure every rank's peak.

``verify_distributed(model, plan, world_size=N)`` starts N processes on this machine (gloo
on CPU, NCCL on GPUs, one GPU per rank), joined over 127.0.0.1 on a free port. Each rank
builds the model with the same seed, checkpoints the plan's layers (``memplan.apply``),
wraps the model with memplan.wrap.wrap_for_plan, as memplan's training scripts do:

* ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)`` and the model file's
  optimizer;
* ``zero1``: the same DDP, with ``torch.distributed.optim.ZeroRedundancyOptimizer`` around
  the optimizer's class (so each rank keeps the state of its parameter partition);
* ``fsdp``: FSDP2 ``fully_shard`` on each of ``plan.shard_units`` (none for a model with no
  layers: the root is the one unit, as the plan predicts it) and then on the root,
  with ``MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=float32)`` when the plan's
  ``mixed_precision`` is ``params``; with ``grad_sync: last_micro_step`` accumulation skips
  the reduce-scatter with ``set_requires_gradient_sync(False)``, with ``every_micro_step``
  every micro-step reduce-scatters into sharded gradients.
(``zero2`` is DeepSpeed's; there is no torch engine to run it with, so it is refused.)
Then it runs 1 + ``steps`` optimizer steps (the first creates the optimizer state) with
``memplan.Accumulator`` on ``make_batch`` batches (different on every rank) under the
probe's tracker, extended (``DistributedTracker``), and reports its peak per rank. On
CUDA ``max_memory_allocated``/``max_memory_reserved`` are reported too. Memory that gloo or
NCCL allocate outside PyTorch tensors is not seen.

A rank that raises, dies or outlives ``timeout_s`` ends the run: the others are killed,
and a ``CannotMeasureError`` says which rank, how, and the tail of its error. It also checks
the gradients (memplan.verify.distributed_grads): the ranks' against the same micro-batches
run the textbook way in one process, and whether micro-batching changes the objective.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memplan.errors import BadInputError, CannotMeasureError
from memplan.files.schema import to_data
from memplan.parallel import float8_layout_refusal, pipeline_refusal_by_kind
from memplan.plan import Plan, plan_to_data
from memplan.probe.tracker import LiveTracker, resident_tensors
from memplan.run.float8 import convert_for_plan, refuse_float8_gather
from memplan.run.wrap import wrap_for_plan
from memplan.verify.distributed_grads import gradient_check, gradient_error
from memplan.verify.grad_check import BatchCoupling
from memplan.verify.loss_handlers import LossHandlers, fake
from memplan.verify.parallel import rank_predictions, run_layout_rank
from memplan.verify.rank_lifetime import (
    RANK_BYTES,
    RunFolder,
    die_with_parent,
    join_group,
    model_exits_contained,
    rank_warnings,
    sigint_held,
    startable_cpu_ranks,
    wait_for_ranks,
    warning_text,
)
from memplan.verify.single import (
    GradientCheck,
    Verdict,
    last_step_timeline,
    predicted_for_device,
)

DEFAULT_TIMEOUT_S = 300.0
"""Wall-clock limit of the whole run (start-up, steps, gradient check) unless given."""
RUNNABLE_STRATEGIES = ("ddp", "zero1", "fsdp")
__all__ = ["DistributedTracker", "verify_distributed", "wrap_for_plan"]


# --------------------------------------------------------------------------- the instrument
class DistributedTracker(LiveTracker):
    """The probe's tracker, also counting what torch.distributed hides from it:

    * DTensor (FSDP2's sharded parameters, gradients and optimizer state) is a wrapper
      subclass with no storage of its own: its inner local tensors are counted instead;
    * FSDP2 frees and re-allocates unsharded parameters with ``UntypedStorage.resize_``,
      which no aten op reports: ``resize_`` is wrapped while the tracker is active.

    And loss parallel's handler temporaries (verify.loss_handlers). Not counted: storages
    first seen in ``reduce_scatter_single`` (gloo's copy of its input, freed at varying
    times; NCCL makes none). Before a new peak it yields the GIL for ``settle_s``: gloo's
    worker thread drops a finished collective's buffers after the caller has resumed
    (ProcessGroupGloo::runLoop), so one rank in four had held 24 KiB more at its peak."""

    _in_collective = False
    settle_s = 0.001

    def _add_tensor(self, tensor: torch.Tensor) -> None:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if self._in_collective:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                if id(tensor.untyped_storage()) not in self._storages:
                    return

        if fake(tensor):  # DTensor's shape propagation (meta or fake tensors): no memory
            return
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                inner = getattr(tensor, name, None)
                if isinstance(inner, torch.Tensor):
                    self._add_tensor(inner)
            return
        super()._add_tensor(tensor)

    def _resized(self, storage: Any) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        entry = self._storages.get(key)
        if entry is None:
            if nbytes:
                ref = weakref.ref(storage, lambda _ref, key=key: self._free(key))
                self._storages[key] = (ref, nbytes)
                self.live_bytes += nbytes
        else:
            self.live_bytes += nbytes - entry[1]
            self._storages[key] = (entry[0], nbytes)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __enter__(self) -> DistributedTracker:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: Any, size: int) -> Any:
            out = original(storage, size)
            tracker._resized(storage)
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        dist = torch.distributed
        self._original_reduce_scatter = dist.reduce_scatter_single

        def reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
            tracker._in_collective = True
            try:
                return tracker._original_reduce_scatter(*args, **kwargs)
            finally:
                tracker._in_collective = False

        dist.reduce_scatter_single = reduce_scatter_single
        self._loss_handlers = LossHandlers(self).wrap()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        torch.distributed.reduce_scatter_single = self._original_reduce_scatter
        self._loss_handlers.restore()
        super().__exit__(*exc)


# --------------------------------------------------------------------------- results
@dataclass(frozen=True, kw_only=True, slots=True)
class RankResult:
    rank: int
    peak_bytes: int
    """What the prediction is compared with: the tracker's peak (CPU), or on CUDA what the
    process held at most (NVML, else max_memory_reserved)."""
    tracker_peak_bytes: int
    step_seconds: float
    effective_batch: int
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None
    timeline: tuple[tuple[int, ...], ...] = ()
    """With ``record_timeline``: live bytes after every op of the last step, per micro-step
    and the optimizer step (memplan.verify.last_step_timeline)."""
    timeline_forward_ops: tuple[int | None, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedVerifyResult(Verdict):
    plan: Plan
    device: str
    backend: str
    world_size: int
    steps: int
    predicted_peak_bytes: int
    """Per rank, from the plan (with a pipeline layout: its worst stage's)."""
    ranks: tuple[RankResult, ...]
    tolerance: float
    gradient_check: GradientCheck
    batch_coupling: BatchCoupling
    predicted_step_seconds: float
    predicted_rank_peaks: tuple[int, ...] = ()
    """Each rank's predicted peak (with a pipeline layout its stage's, else the plan's);
    empty only from an older caller, and then every rank has ``predicted_peak_bytes``."""

    def predicted_for_rank(self, rank: int) -> int:
        if self.predicted_rank_peaks:
            return self.predicted_rank_peaks[rank]
        return self.predicted_peak_bytes

    @property
    def measured_peak_bytes(self) -> int:
        """The largest rank's peak."""
        return max(r.peak_bytes for r in self.ranks)

    def rank_error(self, rank: int) -> float:
        """(predicted − measured) / measured for one rank."""
        measured = self.ranks[rank].peak_bytes
        return (self.predicted_for_rank(rank) - measured) / max(measured, 1)

    @property
    def worst_rank(self) -> int:
        """The rank the verdict quotes: one over the budget first, then the largest |error|."""
        return max(
            (r.rank for r in self.ranks),
            key=lambda r: (
                self.ranks[r].peak_bytes > self.plan.budget_bytes,
                abs(self.rank_error(r)),
            ),
        )

    @property
    def peak_error(self) -> float:
        """The worst rank's error (``worst_rank``)."""
        return self.rank_error(self.worst_rank)

    def peak_failures(self) -> list[str]:
        """Verdict's peak failures, each naming its rank (the largest |error| is judged)."""
        off = max((r.rank for r in self.ranks), key=lambda r: abs(self.rank_error(r)))
        out = []
        if abs(error := self.rank_error(off)) > self.tolerance:
            out.append(f"rank {off}: peak error {error:+.1%} is outside ±{self.tolerance:.0%}")
        over = [str(r.rank) for r in self.ranks if r.peak_bytes > self.plan.budget_bytes]
        if over:
            ranks = f"rank{'s' if len(over) > 1 else ''} {', '.join(over)}"
            out.append(f"{ranks}: measured peak is over the budget")
        return out

    @property
    def measured_step_seconds(self) -> float:
        return max(r.step_seconds for r in self.ranks)

    def json_data(self) -> dict[str, Any]:
        """The result as JSON data with the verdict's derived fields; per-op bytes are for
        ``--report``, not the JSON."""
        data = to_data(self)
        for rank in data["ranks"]:
            rank.pop("timeline", None)
        data.update(
            measured_peak_bytes=self.measured_peak_bytes,
            peak_error=self.peak_error,
            rank_errors=[self.rank_error(r.rank) for r in self.ranks],
        )
        return {**data, **self.verdict_data()}


# --------------------------------------------------------------------------- the worker
def _loopback_interface() -> str | None:
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound there only, then released for the store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, config: dict[str, Any]) -> None:
    """One rank. Writes ``rank<r>.json`` (result or error) into ``config['folder']``."""
    folder = Path(config["folder"])
    die_with_parent(int(config["parent_pid"]), folder)
    try:
        # a rank's Python warnings go to its JSON, not raw to the shared stderr: the parent
        # says each once, for every rank that raised it (rank_warnings)
        with warnings.catch_warnings(record=True) as caught, model_exits_contained(config):
            warnings.simplefilter("default")
            result = config.get("rank_fn", _run_rank)(rank, config)
        result["warnings"] = [warning_text(w) for w in caught]
        (folder / f"rank{rank}.json").write_text(json.dumps(result))
        torch.distributed.barrier()  # no rank tears gloo down while a peer still talks to it
        (folder / f"rank{rank}.done").touch()  # every rank reported: reported_before_teardown
    except BaseException as exc:
        (folder / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "error": f"{type(exc).__name__}: {exc}",
                    "bad_input": isinstance(exc, BadInputError),
                    "message": str(exc),
                    "trace": traceback.format_exc(),
                    "time": time.time(),  # the first error is the cause: rank_failure
                }
            )
        )
        raise
    finally:
        dist = torch.distributed
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _run_rank(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    from memplan import run
    from memplan.model.batch import map_batch
    from memplan.model.loader import load_model_file
    from memplan.plan import plan_from_data
    from memplan.probe.session import users_backward
    from memplan.verify.single import fingerprint_note

    dist = torch.distributed
    world = int(config["world_size"])
    cuda = config["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    join_group(rank, config, "nccl" if cuda else "gloo")
    plan = plan_from_data(config["plan"], source="plan")
    parallel = plan.parallel
    if parallel is not None and (parallel.tp > 1 or parallel.pp > 1 or parallel.cp > 1):
        return run_layout_rank(rank, config, plan, parallel, DistributedTracker(record=False))
    mf = load_model_file(config["model"]).at_seq_len(plan.seq_len)
    micro, k, seed = plan.micro_batch_size, plan.accumulation_steps, int(config["seed"])

    torch.manual_seed(seed)
    net = mf.build_model().to(device).train()
    fingerprint_note(plan, net, str(config["model"]))  # raises for another model's plan
    convert_for_plan(net, plan, device)  # float8 linears (memplan.run.float8)
    run.apply(net, plan)
    record = bool(config.get("record_timeline"))
    tracker = DistributedTracker(record=False)
    tracker.track(resident_tensors(net, None, None))
    with tracker:  # DDP's buckets are made here: count them
        model, optimizer = wrap_for_plan(net, plan, mf.make_optimizer, device)
    acc = run.Accumulator(model, optimizer, plan, device=device)
    torch.manual_seed(seed + 1 + rank)  # different batches on every rank
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    tracker.peak_bytes = tracker.live_bytes  # construction transients are not the step's
    tracker.record = record
    marks: list[int] = []
    step_marks: list[int] = []
    forward_marks: list[int] = []
    hook = optimizer.register_step_pre_hook(lambda *_: step_marks.append(tracker.position))
    fwd_hook = net.register_forward_hook(lambda *_: forward_marks.append(tracker.position))
    effective = 0
    with tracker:  # the first step creates optimizer state: measure it and `steps` more
        for _ in range((config["steps"] + 1) * k):
            marks.append(tracker.position)
            with users_backward(mf):  # an error in the backward: the model file's
                metrics = acc.step(mf.make_batch(micro), mf.loss)
            if metrics["stepped"]:
                effective = int(metrics["effective_batch"])
    hook.remove()
    fwd_hook.remove()
    timeline, forward_ops = (
        last_step_timeline(tracker.values, marks, step_marks, k, forward_marks)
        if record
        else ((), ())
    )
    alloc = torch.cuda.max_memory_allocated(device) if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) if cuda else None
    dist.barrier()
    start = time.perf_counter()
    for _ in range(config["steps"] * k):
        with users_backward(mf):
            acc.step(mf.make_batch(micro), mf.loss)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / config["steps"]
    measured = tracker.peak_bytes
    if cuda:
        from memplan.devices import local_gpu

        info = local_gpu(rank)
        held = info.process_used_bytes if info else None
        measured = held if held is not None else int(reserved or 0)
    out: dict[str, Any] = {
        "rank": rank,
        "peak_bytes": int(measured),
        "tracker_peak_bytes": int(tracker.peak_bytes),
        "step_seconds": seconds,
        "effective_batch": effective,
        "cuda_max_allocated_bytes": alloc,
        "cuda_max_reserved_bytes": reserved,
        "timeline": timeline,
        "timeline_forward_ops": forward_ops,
    }
    del acc, optimizer, model, net
    if config["check_gradients"]:
        out["gradient_error"] = gradient_error(mf, plan, device, seed, rank, world, map_batch)
    return out


# --------------------------------------------------------------------------- the driver
def _resolve_device(plan: Plan, device: str | None, world: int) -> str:
    chosen = device or (plan.device if plan.device in ("cpu", "cuda") else "auto")
    if chosen == "auto":
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
    if chosen not in ("cpu", "cuda"):
        raise BadInputError(f"--device {chosen!r}: verify runs on cpu or cuda.")
    if chosen == "cuda":
        if not torch.cuda.is_available():
            raise CannotMeasureError("--device cuda, but no CUDA GPU is available.")
        if torch.cuda.device_count() < world:
            raise CannotMeasureError(
                f"{world} ranks need {world} GPUs; this machine has {torch.cuda.device_count()}.",
                hint="Verify with fewer ranks (a plan solved for them), or on CPU.",
            )
    elif world > (most := startable_cpu_ranks()):
        raise BadInputError(
            f"verify would start {world:,} ranks; this machine can start at most {most:,} "
            f"(its available memory at {RANK_BYTES // 2**20} MiB per rank, and its process "
            "limit).",
            hint="Verify a plan solved for fewer ranks (--world-size), or run it on its cluster.",
        )
    return chosen


def _check_pipeline(plan: Plan) -> None:
    """A plan with pipeline stages for a model memplan cannot split (memplan.parallel's
    rule, the one ``solve`` follows), refused before any rank starts."""
    layout, fingerprint = plan.parallel, plan.model_fingerprint
    if layout is None or layout.pp == 1 or fingerprint is None:
        return
    why = pipeline_refusal_by_kind(plan.model, fingerprint.hf_blocks)
    if why is not None:
        raise BadInputError(
            f"The plan has {layout.pp} pipeline stages: {why}.",
            hint="Solve it again with --pp 1 (memplan solve no longer plans such stages).",
        )


def verify_distributed(
    model: str,
    plan: Plan,
    *,
    world_size: int | None = None,
    steps: int = 3,
    device: str | None = None,
    tolerance: float = 0.05,
    check_gradients: bool = True,
    seed: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_progress: Callable[[int, int, str], None] | None = None,
    record_timeline: bool = False,
) -> DistributedVerifyResult:
    """Run ``plan`` on ``world_size`` processes (default: the plan's) and measure each rank;
    see the module doc. Raises ``BadInputError`` for a plan it cannot run here and
    ``CannotMeasureError`` when a rank fails, dies or times out."""
    world = plan.world_size if world_size is None else world_size
    _check_runnable(plan, world, steps)
    chosen = _resolve_device(plan, device, world)
    if (why := float8_layout_refusal(plan)) is not None and plan.parallel is not None:
        # (before, it ran them in bf16 and set the figures against float8's prediction)
        raise BadInputError(
            f"verify cannot run a float8 plan with {plan.parallel.describe()}: {why}.",
            hint="Verify the float8 profile solved without --tp/--pp, or the bf16 profile "
            "with this layout.",
        )
    refuse_float8_gather(plan, torch.device(chosen))  # before any rank starts
    config = {
        "parent_pid": os.getpid(),
        "world_size": world,
        "device": chosen,
        "port": free_port(),
        "timeout_s": timeout_s,
        "plan": plan_to_data(plan),
        "model": model,
        "seed": seed,
        "steps": steps,
        "check_gradients": check_gradients,
        "record_timeline": record_timeline,
    }
    raw = run_ranks(config, on_progress or (lambda done, total, what: None))
    for text in rank_warnings([r.get("warnings", []) for r in raw]):
        warnings.warn(text, UserWarning, stacklevel=2)  # the CLI says it as one warning: line
    grad, couple = gradient_check(
        plan, [r.get("gradient_error") for r in raw], check_gradients, world
    )
    return DistributedVerifyResult(
        plan=plan,
        device=chosen,
        backend="nccl" if chosen == "cuda" else "gloo",
        world_size=world,
        steps=steps,
        predicted_peak_bytes=predicted_for_device(plan, chosen)[0],
        ranks=tuple(_rank_result(r) for r in raw),
        tolerance=tolerance,
        gradient_check=grad,
        batch_coupling=couple,
        predicted_step_seconds=plan.predicted.step_seconds,
        predicted_rank_peaks=rank_predictions(plan, chosen, world)
        or (predicted_for_device(plan, chosen)[0],) * world,
    )


def _check_runnable(plan: Plan, world: int, steps: int) -> None:
    """Refuse (BadInputError) a plan this engine cannot run on ``world`` ranks."""
    if world != plan.world_size:
        raise BadInputError(
            f"The plan is for {plan.world_size} rank(s), not {world}: per-rank memory and the "
            "effective batch depend on the world size.",
            hint=f"Solve again with --world-size {world}.",
        )
    if world < 2:
        raise BadInputError("verify_distributed needs at least 2 ranks; use verify_plan.")
    if steps < 1:
        raise BadInputError(f"--steps must be at least 1, got {steps}.")
    if plan.strategy not in RUNNABLE_STRATEGIES:
        raise BadInputError(
            f"Strategy {plan.strategy} is DeepSpeed's; verify runs the torch engines only "
            f"({', '.join(RUNNABLE_STRATEGIES)}).",
            hint="Run it under DeepSpeed (memplan solve --format deepspeed) and compare its "
            "memory report, or solve with --strategy zero1 or fsdp.",
        )
    _check_pipeline(plan)


def run_ranks(
    config: dict[str, Any], progress: Callable[[int, int, str], None]
) -> list[dict[str, Any]]:
    """Start ``config["world_size"]`` ranks on this machine, wait for them (or the time
    limit), and return what each wrote; a failed run raises its clearest account. Each rank
    runs ``config["rank_fn"](rank, config)`` (a module-level function; default: memplan's
    own runtime, ``_run_rank``), which joins the process group at ``config["port"]`` and
    returns its JSON-ready result (bench.engines runs torchtitan's parallelisation so)."""
    import torch.multiprocessing as mp

    world, timeout_s = config["world_size"], config["timeout_s"]
    with RunFolder() as run:  # the ranks and this folder end with us: memplan.rank_lifetime
        folder = run.path
        config = {**config, "folder": str(folder)}
        env = {"MASTER_ADDR": "127.0.0.1"}
        interface = _loopback_interface()
        if interface and config["device"] == "cpu":
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        backend = "nccl" if config["device"] == "cuda" else "gloo"
        progress(0, 1, f"starting {world} ranks ({backend})")
        processes: list[Any] = []
        try:
            with sigint_held():  # a Ctrl-C now: one "interrupted", no rank's traceback
                try:
                    context = mp.start_processes(
                        _worker, args=(config,), nprocs=world, join=False, start_method="spawn"
                    )
                finally:
                    for key, value in saved.items():
                        if value is None:
                            os.environ.pop(key, None)
                        else:
                            os.environ[key] = value
                processes = list(context.processes)
                run.watch(process.pid for process in processes)
            torn = wait_for_ranks(processes, folder, timeout_s, config.get("model"))
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
            run.ranks_ended()
        progress(1, 1, "done")
        results = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
        if torn:
            for result in results:
                result.setdefault("warnings", []).append(torn)
        return results


def _rank_result(r: dict[str, Any]) -> RankResult:
    return RankResult(
        rank=r["rank"],
        peak_bytes=r["peak_bytes"],
        tracker_peak_bytes=r["tracker_peak_bytes"],
        step_seconds=r["step_seconds"],
        effective_batch=r["effective_batch"],
        cuda_max_allocated_bytes=r["cuda_max_allocated_bytes"],
        cuda_max_reserved_bytes=r["cuda_max_reserved_bytes"],
        timeline=tuple(tuple(piece) for piece in r.get("timeline", ())),
        timeline_forward_ops=tuple(r.get("timeline_forward_ops", ())),
    )
