# Two entry points (README): `make demo` and `make test`. Both set up the environment first.
VENV ?= .venv
PY := $(VENV)/bin/python
MMRL := $(VENV)/bin/mmrl
STAMP := $(VENV)/.mmrl-setup-v1
MODEL ?= work/tiny-vlm
DATA ?= work/data/colors
CONFIG ?= configs/colors_demo.yaml
ARGS ?=
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast test-learning bench assets clean-runs

setup: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml setup.py scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)

$(MODEL)/config.json: | $(STAMP)
	$(MMRL) tiny-model --arch qwen2_5_vl --out $(MODEL)

$(DATA)/dataset.json: | $(STAMP)
	$(MMRL) data build colors --out $(DATA)

assets: $(MODEL)/config.json $(DATA)/dataset.json

demo: setup assets
	$(MMRL) train $(CONFIG) model.path=$(MODEL) $(ARGS)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-learning: setup  # every task config and model family learns (test_task_configs, test_families): tens of minutes each on 2 cores
	$(PY) -m pytest -q -m learning $(PYTEST_ARGS)

# every benchmark in its quick version (writes to runs/bench-quick, not benchmarks/results)
bench: setup assets
	$(PY) benchmarks/quick.py

clean-runs:
	rm -rf runs
