# memplan's everyday commands. `make install` makes .venv/ with the CPU build of torch first,
# so an unpinned torch never pulls a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test test-fast lint format bench bench-deps gpu-check clean

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

clean:
	rm -rf $(VENV) out .pytest_cache
