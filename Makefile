# The user's verbs. Two set-up commands on a fresh Debian 12 machine: `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
LOCKS := containers/lock
RECIPE ?= recipes/tiny-cpu.yaml
RUN_ARGS ?= --resume
PYTEST_ARGS ?=
# Three pytest-xdist workers where there are two cores or more, one per group of tests (tests/conftest.py says which
# go together and why three: the Slurm group waits on Slurm half its time), else none.
TEST_WORKERS ?= $(shell [ "$$(nproc)" -ge 2 ] && echo 3 || echo 0)

FLAVOR ?= cpu
MIRROR ?=

.PHONY: lock-python lock-debian setup setup-dev run data test test-slurm lint lock bench chaos clean image apptainer prometheus slurm-testbed verify-image module-table docs docs-reference

# The training stack, from the hash-pinned lock (the CPU image installs the same lock).
$(VENV)/.stamp-cpu: $(LOCKS)/cpu.txt $(LOCKS)/bench.txt pyproject.toml ci/find-python
	@python=$$(ci/find-python) || exit 1; \
	if ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	  echo "rkit: creating $(VENV) with $$python"; rm -rf $(VENV); "$$python" -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install --quiet --require-hashes -r $(LOCKS)/cpu.txt
	$(PY) -m pip install --quiet --require-hashes -r $(LOCKS)/bench.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation --editable .
	@touch $@

# Test tools on top (dev.txt is cpu.txt plus pytest, hypothesis, ruff; same pins), and mkdocs (docs.txt).
$(VENV)/.stamp-dev: $(VENV)/.stamp-cpu $(LOCKS)/dev.txt $(LOCKS)/docs.txt
	$(PY) -m pip install --quiet --require-hashes -r $(LOCKS)/dev.txt
	$(PY) -m pip install --quiet --require-hashes -r $(LOCKS)/docs.txt
	@touch $@

# rkit's own modules as bytecode, as pip compiles what it installs (an editable install compiles nothing): where
# PYTHONDONTWRITEBYTECODE is set, every rkit process (each CLI call, supervisor, host rank) compiled its modules from
# source otherwise, 0.2-0.3 s of CPU each (`rkit status` 0.85 -> 0.50 s). compileall skips what is up to date.
setup: $(VENV)/.stamp-cpu
	@$(PY) -m compileall -q launch
setup-dev: $(VENV)/.stamp-dev setup

run: setup
	$(VENV)/bin/rkit run $(RECIPE) $(RUN_ARGS)
	@echo "rkit: the CLI is $(VENV)/bin/rkit (or: source $(VENV)/bin/activate, then rkit status, rkit ls, rkit report)"

# A small text data set for recipes/tiny-grain.yaml (docs/data.md): tf.train.Example records as ArrayRecord and
# TFRecord in data/tiny-text/, the same bytes on every machine, nothing downloaded.
data: setup
	$(PY) -m rkit.recipe.sampledata data/tiny-text

# A real Apptainer (ci/install-apptainer.sh: Debian 12, root). Without root it says why; the image tests then
# skip on a laptop and fail in CI (CI=true).
apptainer:
	@command -v apptainer >/dev/null || ci/install-apptainer.sh || \
	  echo "rkit: warning: no apptainer (ci/install-apptainer.sh needs root on Debian 12); image tests cannot run"

# A real Prometheus server for the exporter's test (ci/install-prometheus.sh: Debian 12's package, root; its
# service is not left running). Without root it says why; that test then skips on a laptop and fails in CI.
prometheus:
	@command -v prometheus >/dev/null || ci/install-prometheus.sh || \
	  echo "rkit: warning: no prometheus (ci/install-prometheus.sh needs root on Debian 12); its test cannot run"

# Everything: unit tests, real MaxText, real Apptainer, real Prometheus, and the Slurm tests on the test bed.
# It ends with its wall time since make started (set-up included; the suite's budget is 30 minutes on 2 cores) and
# pytest's summary of the ten slowest tests (tests/conftest.py).
MAKE_STARTED := $(shell date +%s)
test: setup-dev apptainer prometheus slurm-testbed
	$(VENV)/bin/ruff check launch tests
	@started=$$(date +%s); $(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS); rc=$$?; \
	  now=$$(date +%s); echo "make test: $$((now - $(MAKE_STARTED))) s in all, set-up $$((started - $(MAKE_STARTED))) s, pytest $$((now - started)) s (exit $$rc)"; exit $$rc

# The Slurm test bed (ci/slurm-testbed.sh: Slurm 24.11 + Apptainer in a Debian 13 root, 3 nodes; root on
# Debian 12). Without root it says why; the Slurm tests then skip on a laptop and fail in CI.
slurm-testbed:
	@ci/slurm-testbed.sh up >/dev/null || \
	  echo "rkit: warning: no Slurm test bed (ci/slurm-testbed.sh up needs root on Debian 12); Slurm tests cannot run"

# The documentation site into site/ (mkdocs.yml), strictly: a warning, a broken link or anchor is an error.
docs: setup-dev
	$(PY) -m mkdocs build --strict --site-dir site

# The generated pages: docs/reference/ (recipe keys, CLI, events, exit codes) and docs/modules.md, from the code
# (tests/unit/test_docs.py and test_module_table.py fail while one is stale).
docs-reference: setup-dev
	$(PY) ci/docs_reference.py
	$(PY) ci/module_table.py > docs/modules.md

module-table:
	python3 ci/module_table.py > docs/modules.md

# Only the Slurm launcher's tests.
test-slurm: setup-dev apptainer slurm-testbed
	$(PY) -m pytest -m slurm $(PYTEST_ARGS)

# An image into the content-addressed cache (~/.cache/rkit/images); an unchanged key returns at once.
# MIRROR=... overrides the Debian mirror of the cpu and cuda images (default: the dated snapshot in their .def).
image: setup apptainer
	$(VENV)/bin/rkit image build $(FLAVOR) $(if $(MIRROR),--build-arg MIRROR=$(MIRROR))

# A fault campaign (tests/benchmarks/chaos.py): for each seed (SEEDS, default 1 2 3), 20 faults drawn from the
# matrix rkit handles fired into one real run on the Slurm test bed at Slurm's default timeouts, on real data, with
# warm standbys and the node-local tier; each checked (finished, the uninterrupted run's loss, every fault named,
# nothing left running or half-written) and reported. Not part of make test: about 15-25 minutes a seed. The test
# bed's nodes see /tmp and the checkout it was started from, so run it from that checkout.
SEEDS ?= 1 2 3
chaos: setup-dev apptainer slurm-testbed
	@sif=$$($(VENV)/bin/rkit image build cpu $(if $(MIRROR),--build-arg MIRROR=$(MIRROR)) | tail -1) && \
	  eval "$$(ci/slurm-testbed.sh env)" && \
	  $(PY) tests/benchmarks/chaos.py --image "$$sif" $(foreach s,$(SEEDS),--seed $(s))

# The full cpu image built a second time from nothing, compared byte for byte with the cached one (4-40 minutes;
# make test proves the same machinery on the small base image).
verify-image: setup-dev apptainer
	$(PY) -m pytest -m verify_image tests/integration/test_images.py $(PYTEST_ARGS)

lint: setup-dev
	$(VENV)/bin/ruff check launch tests

# Re-resolve the locks (needs PyPI). uv itself comes from a hash-pinned lock too. The cpu lock is universal
# (Python 3.12+, any platform: the laptop venv and the cpu image); cuda is for Debian trixie's Python 3.13 on
# x86_64 manylinux_2_28 (the debootstrapped cuda image), rocm for Python 3.12 on the same platform (AMD's
# base image). cpu.constraints.txt keeps the verified CPU set from drifting; the ROCm plugin needs jax 0.12.0,
# so rocm takes those constraints without the jax pins.
UV_COMPILE = .venv-lock/bin/uv pip compile --generate-hashes --python-version 3.12 --custom-compile-command "make lock"
UV_COMPILE_313 = .venv-lock/bin/uv pip compile --generate-hashes --python-version 3.13 --custom-compile-command "make lock"
lock: lock-python lock-debian

# The Debian packages of the cpu image as the mirror gives them now (a cpu image build): containers/lock/debian-trixie.txt (bases.json's debian_lock).
lock-debian: setup apptainer
	$(VENV)/bin/rkit image build cpu --refresh-debian-lock $(if $(MIRROR),--build-arg MIRROR=$(MIRROR))

lock-python:
	@python=$$(ci/find-python) || exit 1; \
	[ -x .venv-lock/bin/uv ] || { "$$python" -m venv .venv-lock && \
	  .venv-lock/bin/pip install --quiet --require-hashes -r $(LOCKS)/tools.txt; } || exit 1
	$(UV_COMPILE) --universal $(LOCKS)/cpu.in -c $(LOCKS)/cpu.constraints.txt -o $(LOCKS)/cpu.txt
	$(UV_COMPILE) --universal $(LOCKS)/dev.in -c $(LOCKS)/cpu.txt -c $(LOCKS)/cpu.constraints.txt -o $(LOCKS)/dev.txt
	$(UV_COMPILE) --universal $(LOCKS)/bench.in -c $(LOCKS)/cpu.txt -c $(LOCKS)/dev.txt -o $(LOCKS)/bench.txt
	$(UV_COMPILE) --universal $(LOCKS)/docs.in -c $(LOCKS)/cpu.txt -c $(LOCKS)/dev.txt -c $(LOCKS)/bench.txt \
	  -o $(LOCKS)/docs.txt
	$(UV_COMPILE_313) --python-platform x86_64-manylinux_2_28 $(LOCKS)/cuda.in -c $(LOCKS)/cpu.constraints.txt \
	  -o $(LOCKS)/cuda.txt
	$(UV_COMPILE) --python-platform x86_64-manylinux_2_28 $(LOCKS)/rocm.in \
	  -c <(grep -v '^jax' $(LOCKS)/cpu.constraints.txt) -o $(LOCKS)/rocm.txt

clean:
	rm -rf $(VENV) .venv-lock .pytest_cache .ruff_cache site

# Restart latency vs cold start, median of 3, side by side (real MaxText; ~3 minutes).
bench: setup
	$(PY) tests/benchmarks/restart_latency.py --repeats 3
	$(PY) tests/benchmarks/hang_detection.py --repeats 3
	$(PY) tests/benchmarks/telemetry_overhead.py --repeats 3
	$(PY) tests/benchmarks/status_scale.py --repeats 3
	$(PY) tests/benchmarks/fixed_cost.py --pairs 4
	$(PY) tests/benchmarks/supervisor_scale.py --ranks 512 --seconds 60
	$(PY) tests/benchmarks/long_run.py --repeats 3
	$(PY) tests/benchmarks/liveness_sim.py --nodes 4096 --seconds 70
	$(PY) tests/benchmarks/gate_noise.py --pairs 10 --repeats 2
	$(PY) tests/benchmarks/checkpoint_cadence.py --steps 9000 --repeats 1
	$(PY) tests/benchmarks/local_tier.py --crashes 6
	$(PY) tests/benchmarks/data_fingerprint.py --repeats 200
	@# on the Slurm test bed, with the cpu image built (make image): a run chained through 12 time limits
	@sif=$$(ls -t $$HOME/.cache/rkit/images/cpu-*.sif 2>/dev/null | head -1); \
	if [ -n "$$sif" ] && ci/slurm-testbed.sh status >/dev/null 2>&1; then \
	  eval "$$(ci/slurm-testbed.sh env)" && $(PY) tests/benchmarks/requeue_chain.py --image "$$sif"; \
	else echo "rkit: requeue_chain.py skipped: it needs the Slurm test bed up and a cpu image (make image)"; fi
