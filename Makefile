# Two commands for a fresh machine: `make demo` runs the main job on the CPU demo, `make test` runs the tests.
# Both create the virtualenv .venv on first use (torch is pinned to the CPU wheel).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[cli,test,mergekit,telemetry,distributed,gguf]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/ram-trl demo --out demo_out

# DeepSpeed's CPU extension is built per virtualenv (a killed build's stale lock in the shared ~/.cache would hang
# every later DeepSpeed test: docs/ci.md); a TORCH_EXTENSIONS_DIR the caller sets wins. The tests run in one
# pytest-xdist worker per core (at most 4), each test file on one worker (its module fixtures are built once);
# `make test TEST_WORKERS=0` runs them in this process.
TEST_WORKERS ?= auto
test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	TORCH_EXTENSIONS_DIR="$${TORCH_EXTENSIONS_DIR:-$(abspath $(VENV))/torch_extensions}" $(BIN)/python -m pytest -q \
		-n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile --durations=25

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .venv .venv-ci .venv-ppo example_out demo_out
