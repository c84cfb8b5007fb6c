# memplan's everyday commands. `make install` makes .venv/ with the CPU build of torch first,
# so an unpinned torch never pulls a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test test-fast lint format bench bench-deps gpu-check gpu-check-system megatron-check clean

$(BIN)/memplan: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q torch==$(TORCH_VERSION) -e '.[dev]'
	touch $(BIN)/memplan

install: $(BIN)/memplan

demo: install
	@mkdir -p out
	$(BIN)/memplan probe examples/gpt.py --device cpu -o out/gpt.profile.yaml --force
	$(BIN)/memplan solve out/gpt.profile.yaml --target-batch 32 --budget 80MiB -o out/plan.yaml --format torch,hf,deepspeed --force
	$(BIN)/memplan verify examples/gpt.py out/plan.yaml --steps 2

test: install
	$(BIN)/pytest -q --durations=25

# The quick loop: the pure core (memory, solver, plan, profile, emit, schema, CLI parsing);
# no real probes, no training runs, no spawned ranks. Under 2 minutes on 2 cores.
test-fast: install
	$(BIN)/pytest -q -m fast

lint: install
	$(BIN)/ruff check memplan tests bench examples
	$(BIN)/ruff format --check memplan tests bench examples

format: install
	$(BIN)/ruff format memplan tests bench examples
	$(BIN)/ruff check --fix memplan tests bench examples

bench-deps: install
	$(BIN)/pip install -q -e '.[dev,bench]'

bench: bench-deps
	$(BIN)/python -m bench.run --device cpu

gpu-check: bench-deps
	$(BIN)/python -m bench.run --device cuda

# The same on a GPU machine that installs nothing (no network): its python3 must already
# hold a CUDA torch, typer, rich, pyyaml and nvidia-ml-py; memplan is read from this tree.
gpu-check-system:
	PYTHONPATH=$(CURDIR) python3 -m bench.run --device cuda

# --format megatron against Megatron-LM's own argument parser (add_megatron_arguments), which
# no package on the index ships (megatron-core's wheel has megatron/core only): the parser's
# packages from Megatron-LM's source at the tag of the pinned megatron-core, kept in .cache/.
# Needs github.com (CI has only the package registries, where the test skips). The test
# fails here, rather than skipping, when the parser does not import.
MEGATRON_LM_REF ?= core_v0.16.1
MEGATRON_LM_URL ?= https://github.com/NVIDIA/Megatron-LM/archive/refs/tags/$(MEGATRON_LM_REF).tar.gz
MEGATRON_LM ?= .cache/megatron-lm/$(MEGATRON_LM_REF)

megatron-check: install
	@if [ ! -d $(MEGATRON_LM)/megatron/training ]; then \
	  rm -rf $(MEGATRON_LM).part && mkdir -p $(MEGATRON_LM).part && \
	  curl -fsSL $(MEGATRON_LM_URL) | tar xz -C $(MEGATRON_LM).part --strip-components=1 \
	    --wildcards '*/megatron/*' --exclude '*/megatron/core' --exclude '*/megatron/core/*' && \
	  mv $(MEGATRON_LM).part $(MEGATRON_LM); fi
	$(BIN)/pip install -q six==1.17.0
	MEMPLAN_REQUIRE_MEGATRON=1 PYTHONPATH=$(abspath $(MEGATRON_LM)) \
	  $(BIN)/pytest -q -p no:cacheprovider tests/test_emit_engines.py -k megatron

clean:
	rm -rf $(VENV) out .pytest_cache
