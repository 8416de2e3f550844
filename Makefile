# The two commands the README promises. Both build .venv from scratch if it is missing.
# torch is pinned to the CPU build this machine carries; nothing here may pull CUDA torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP_FLAGS := --disable-pip-version-check -q

.PHONY: install demo test lint slow bench bench-deps

# torch is named in the same resolve as the package, so nothing can swap in another build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) "torch==2.13.0"
	$(PY) -m pip install $(PIP_FLAGS) "torch==2.13.0" -e ".[test,s3,mlflow,plot,hf,lightning]"
	# boto3 for the benchmarks' stock rows: the release of the botocore s3fs allowed
	# (boto3 and botocore share version numbers), so pip has nothing to search.
	$(PY) -m pip install $(PIP_FLAGS) "torch==2.13.0" \
		"boto3==$$($(PY) -c 'import botocore; print(botocore.__version__)')"
	# Azurite (Azure Blob emulator, npm) for the az:// store tests; skipped without npm.
	if command -v npm >/dev/null; then npm install --silent --no-audit --no-fund \
		--prefix .tools azurite@3 || echo "azurite not installed: az:// tests skip"; fi
	touch $@

install: $(VENV)/.installed

# The demo needs only the package, torch and matplotlib (its timeline): not the test extras.
$(VENV)/.demo-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) "torch==2.13.0"
	$(PY) -m pip install $(PIP_FLAGS) "torch==2.13.0" -e ".[demo]"
	touch $@

demo: $(VENV)/.demo-installed
	$(VENV)/bin/unbroken demo

lint: install
	$(VENV)/bin/ruff check src tests bench examples

# Two workers, a test file to each at a time (a module's fixtures run once): the suite
# waits on subprocesses and sockets as much as it computes: on a 2-core machine, 590-629 s
# against 1,045 s on one worker. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: install lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

slow: install
	$(PY) -m pytest -q -m slow

# Quick versions of every benchmark (see bench/README.md for the full-size runs).
bench: install
	$(PY) -m bench.storage.store --quick
	$(PY) -m bench.checkpoint.saves --quick
	$(PY) -m bench.checkpoint.save_cpu --quick
	$(PY) -m bench.data.epochs --quick
	$(PY) -m bench.peers.frameworks --quick
	$(PY) -m bench.storage.store --s3 --quick
	$(PY) -m bench.data.epochs --s3 --quick
	$(PY) -m bench.checkpoint.saves --s3 --quick

# What the full runs behind docs/benchmarks.md need beyond `install`: the checkpoint peers
# (s3torchconnector, torch still pinned) and the data peers' own virtualenv.
bench-deps: install
	$(PY) -m pip install $(PIP_FLAGS) "torch==2.13.0" -e ".[test,s3,mlflow,plot,hf,lightning,bench]"
	$(PY) -m bench.peers.loaders --setup
