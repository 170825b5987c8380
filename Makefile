# One entry point for checks. `make test` is what CI runs (see .ci/run).
SHELL := /bin/bash
CARGO ?= cargo
FUZZ_SECONDS ?= 10

.PHONY: toolchain test fmt-check clippy unit moto strace prometheus doc plugins wheel python python-env torch-env lcs-env wheel-env prefetch readme-example gpu-fake fake-cuda libcachesim fuzz-smoke fuzz-seeds demo bench

# Where cargo builds: CARGO_TARGET_DIR when set (the scripts follow it too), target/ otherwise.
TARGET_DIR := $(abspath $(or $(CARGO_TARGET_DIR),target))
export CARGO_TARGET_DIR := $(TARGET_DIR)

# What a step that installs something holds while it does (`flock`): `.ci/run` runs `make prefetch`
# in the background while the Rust builds run, and a step of `make test` that needs the same venv
# or package waits for it and finds it there.
# The install itself runs without the lock's descriptor (`9>&-` after it), so nothing it starts
# (a daemon a package's install script launches) keeps the lock after it.
LOCK = mkdir -p $(TARGET_DIR) && exec 9>$(TARGET_DIR)/.install-$@.lock && flock -w 3600 9 &&
# Debian's packages: one lock for them all (dpkg takes one install at a time).
APT_LOCK = mkdir -p $(TARGET_DIR) && exec 9>$(TARGET_DIR)/.install-apt.lock && flock -w 3600 9 &&

## Everything CI checks: formatting, lints, tests, docs, the plugins, the Python bindings, the
## GPU path against the fake driver, the libCacheSim comparison, a short fuzz run.
test: toolchain fmt-check clippy unit doc plugins python readme-example gpu-fake libcachesim fuzz-smoke
# The Python suites run on a wheel built with the test build's profile, which reuses its compiled
# dependencies: a release build of them all again was the longest step of a clean CI run. The
# wheel is packaged, tagged, checked and installed exactly as `make wheel` does by default
# (`make test WHEEL_PROFILE=release` runs them on a release build).
test: WHEEL_PROFILE = dev

## What the tests install from the network (the venvs, Debian's packages), without building
## anything: `.ci/run` starts it in the background so that downloads overlap the Rust builds.
prefetch: moto strace prometheus wheel-env python-env torch-env lcs-env

## What rustup does not add by itself on every machine (RUSTUP_AUTO_INSTALL=0, or a rustup
## older than the toolchain file's components): quick when they are there already.
toolchain:
	rustup component add rustfmt clippy
	rustup target add wasm32-wasip2

fmt-check:
	$(CARGO) fmt --all --check
	cd plugins && $(CARGO) fmt --all --check

clippy:
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

unit: moto strace prometheus
	$(CARGO) test --workspace --locked

## strace, for the test that counts a reader's opens (tests/ingest_read_verify/open_files.rs): Debian's
## package, installed when the machine lacks it.
strace:
	@$(APT_LOCK) { command -v strace >/dev/null || { apt-get update -q && apt-get install -y -q strace; } >/dev/null; } 9>&-

## Prometheus and promtool, for the test that scrapes a node and a loader (tests/metrics.rs):
## Debian's package, installed when the machine lacks it.
prometheus:
	@$(APT_LOCK) { command -v prometheus >/dev/null && command -v promtool >/dev/null || \
		{ apt-get update -q && apt-get install -y -q --no-install-recommends prometheus; } >/dev/null; } 9>&-

## An S3-compatible server for the object-store tests (tests/origin/, the Python origin test):
## moto in server mode, from PyPI, in its own venv.
MOTO_VENV := $(TARGET_DIR)/moto-venv
export GRANARY_MOTO_SERVER := $(MOTO_VENV)/bin/moto_server
moto:
	@$(LOCK) { test -x $(MOTO_VENV)/bin/moto_server || { python3 -m venv $(MOTO_VENV) && \
		$(MOTO_VENV)/bin/pip install -q 'moto[server]==5.2.5'; }; } 9>&-

doc:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --locked

## The plugins workspace: lints for wasm32-wasip2, and the policies' own tests, run natively.
plugins:
	cd plugins && $(CARGO) clippy --workspace --release --locked --target-dir $(TARGET_DIR)/plugins -- -D warnings
	cd plugins && $(CARGO) test --workspace --locked --target $$(rustc -vV | sed -n 's/^host: //p') --target-dir $(TARGET_DIR)/plugins-native

## The Python package as users install it: `make wheel` builds the wheel once (maturin, release,
## stripped, abi3; WHEEL_PROFILE picks another cargo profile), checks it with auditwheel, and the Python suites below install it into their
## virtual environments and run from outside the source tree, so the tests exercise the installed
## package (its console script `granary` included), not python/granary.
WHEEL_VENV := $(TARGET_DIR)/wheel-venv
WHEELS := $(TARGET_DIR)/wheels
WHEEL_PROFILE ?= release
wheel-env:
	@$(LOCK) { test -x $(WHEEL_VENV)/bin/maturin || { python3 -m venv $(WHEEL_VENV) && \
		$(WHEEL_VENV)/bin/pip install -q 'maturin==1.16.0' 'auditwheel==6.8.2'; }; } 9>&-

wheel: wheel-env
	rm -rf $(WHEELS)
	cd python && $(WHEEL_VENV)/bin/maturin build --profile $(WHEEL_PROFILE) --locked --out $(WHEELS)
	$(WHEEL_VENV)/bin/auditwheel show $(WHEELS)/granary-*.whl | tee $(WHEELS)/auditwheel.txt
	@tr '\n' ' ' < $(WHEELS)/auditwheel.txt | grep -q 'platform tag: "manylinux_' || \
		{ echo "wheel: auditwheel finds no manylinux tag"; exit 1; }

## The Python bindings' pytest suite (NumPy, pyarrow, grain, jax; the torch tests skip without
## torch), on the installed wheel; the replication test runs its console script.
PYVENV := $(TARGET_DIR)/py-venv
python: python-env moto wheel
	$(PYVENV)/bin/pip install -q --force-reinstall --no-deps $(WHEELS)/granary-*.whl
	cd $(TARGET_DIR) && GRANARY_BIN=$(PYVENV)/bin/granary GRANARY_TEST_INSTALLED=1 \
		GRANARY_TEST_MODULES="$(PY_TEST_MODULES)" \
		$(PYVENV)/bin/python -m pytest -q -p no:cacheprovider $(CURDIR)/python/tests

## The oracles of the format tests (webdataset, pyarrow, Hugging Face datasets, grain, jax) are pinned; the
## venv is brought up to this list whenever it changes (a stamp file names it).
PY_TEST_DEPS := 'numpy>=1.23' 'pytest>=7' 'webdataset==1.0.2' 'pyarrow==26.0.1' 'datasets==5.2.0' 'grain==0.2.18' 'jax[cpu]==0.10.2' 'polars==2.1.0' 'duckdb==2.0.0' 'pylance==14.0.2' 'pillow==13.0.0'
# What the suite imports from them: a test that finds one missing would skip; the suite fails instead.
PY_TEST_MODULES := webdataset pyarrow pyarrow.parquet datasets grain jax polars duckdb lance PIL.Image
PY_TEST_STAMP := $(PYVENV)/.deps-$(shell echo "$(PY_TEST_DEPS)" | cksum | cut -d' ' -f1)
python-env:
	@$(LOCK) { test -f $(PY_TEST_STAMP) || { { test -x $(PYVENV)/bin/pip || python3 -m venv $(PYVENV); } && \
		$(PYVENV)/bin/pip install -q $(PY_TEST_DEPS) && touch $(PY_TEST_STAMP); }; } 9>&-

## The README's Python example, run as written with torch installed (PyPI's build; no GPU
## needed), the torch tests, and the format tests whose oracles need torch (Mosaic Streaming's
## MDSWriter and StreamingDataset, LitData's optimize and StreamingDataset), in a venv of their own: with torch present batches are
## tensors, and the suite above runs on NumPy alone.
TORCH_VENV := $(TARGET_DIR)/torch-venv
TORCH_TEST_DEPS := 'numpy>=1.23' 'pytest>=7' 'torch==2.15.0' 'mosaicml-streaming==0.13.0' 'litdata==0.2.76' 'pyarrow==26.0.1'
TORCH_TEST_STAMP := $(TORCH_VENV)/.deps-$(shell echo "$(TORCH_TEST_DEPS)" | cksum | cut -d' ' -f1)
torch-env:
	@$(LOCK) { test -f $(TORCH_TEST_STAMP) || { { test -x $(TORCH_VENV)/bin/pip || python3 -m venv $(TORCH_VENV); } && \
		$(TORCH_VENV)/bin/pip install -q $(TORCH_TEST_DEPS) && touch $(TORCH_TEST_STAMP); }; } 9>&-

readme-example: python torch-env
	$(TORCH_VENV)/bin/pip install -q --force-reinstall --no-deps $(WHEELS)/granary-*.whl
	cd $(TARGET_DIR) && GRANARY_TEST_INSTALLED=1 GRANARY_TEST_MODULES="torch streaming litdata pyarrow PIL.Image" \
		$(TORCH_VENV)/bin/python -m pytest -q -p no:cacheprovider $(CURDIR)/python/tests/test_readme.py \
		$(CURDIR)/python/tests/test_torch.py $(CURDIR)/python/tests/test_mds.py $(CURDIR)/python/tests/test_litdata.py

## The GPU path on a machine without a GPU: the GPU tests (Rust and Python) against
## tests/fake-cuda, a strict stand-in for the CUDA driver (libcuda.so.1) that runs each stream's
## work late and out of order with the others and aborts on misuse a GPU would turn into wrong
## bytes. On a GPU machine the same tests run against the real driver:
## `cargo test --test gpu -- --ignored --skip fake_` and `pytest python/tests`.
FAKE_CUDA := $(TARGET_DIR)/fake-cuda
fake-cuda:
	mkdir -p $(FAKE_CUDA)
	$(CC) -shared -fPIC -pthread -O1 -std=c11 -Wall -Wextra -Werror -Wl,-soname,libcuda.so.1 \
		-o $(FAKE_CUDA)/libcuda.so.1 tests/fake-cuda/fake_cuda.c
	ln -sf libcuda.so.1 $(FAKE_CUDA)/libcuda.so

gpu-fake: fake-cuda python
	LD_LIBRARY_PATH=$(FAKE_CUDA) GRANARY_FAKE_CUDA=1 FAKE_CUDA_DEVICES=2 $(CARGO) test --locked --test gpu --test loader -- --include-ignored
	cd $(TARGET_DIR) && LD_LIBRARY_PATH=$(FAKE_CUDA) GRANARY_FAKE_CUDA=1 FAKE_CUDA_DEVICES=2 FAKE_CUDA_DELAY_US=5000 \
		$(PYVENV)/bin/python -m pytest -q -p no:cacheprovider $(CURDIR)/python/tests/test_cuda.py

## LRU, FIFO, SIEVE, S3-FIFO and the plan-aware evictor against libCacheSim on the same traces,
## with libCacheSim's Python package in a venv of its own.
LCS_VENV := $(TARGET_DIR)/lcs-venv
lcs-env:
	@$(LOCK) { test -x $(LCS_VENV)/bin/python && $(LCS_VENV)/bin/python -c 'import libcachesim' 2>/dev/null || \
		{ python3 -m venv $(LCS_VENV) && $(LCS_VENV)/bin/pip install -q libcachesim==0.3.5; }; } 9>&-

libcachesim: lcs-env
	@# --workspace --tests: the packages and feature set `cargo test --workspace` built with, so
	@# nothing is rebuilt (`-p granary` alone unifies other features and rebuilt the engine).
	$(CARGO) build --workspace --tests --locked
	$(LCS_VENV)/bin/python scripts/compare-libcachesim.py --granary $(TARGET_DIR)/debug/granary

## Seeds the fuzz corpora with real shards, manifests, refs and samples, and with the Parquet, MDS
## and LitData datasets in fuzz/seeds/ that their own writers wrote (so mutations start from valid
## files), then fuzzes each target for FUZZ_SECONDS. Needs nightly and cargo-fuzz, which
## .ci/run installs; elsewhere: `rustup toolchain install nightly && cargo install cargo-fuzz`.
fuzz-smoke: fuzz-seeds
	@if ! $(CARGO) +nightly fuzz --version >/dev/null 2>&1; then \
		echo "fuzz-smoke: needs nightly and cargo-fuzz (installed by .ci/run)"; exit 1; fi
	cd fuzz && $(CARGO) +nightly fuzz run shard_decode corpus/shard_decode -- -max_total_time=$(FUZZ_SECONDS) -seed=1
	cd fuzz && $(CARGO) +nightly fuzz run object_decode corpus/object_decode -- -max_total_time=$(FUZZ_SECONDS) -seed=1
	cd fuzz && $(CARGO) +nightly fuzz run frame_decode corpus/frame_decode -- -max_total_time=$(FUZZ_SECONDS) -seed=1
	cd fuzz && $(CARGO) +nightly fuzz run tar_decode corpus/tar_decode -- -max_total_time=$(FUZZ_SECONDS) -seed=1
	cd fuzz && $(CARGO) +nightly fuzz run fragment_decode corpus/fragment_decode -- -max_total_time=$(FUZZ_SECONDS) -seed=1
	cd fuzz && $(CARGO) +nightly fuzz run parquet_decode corpus/parquet_decode -- -max_total_time=$(FUZZ_SECONDS) -seed=1
	cd fuzz && $(CARGO) +nightly fuzz run mds_decode corpus/mds_decode -- -max_total_time=$(FUZZ_SECONDS) -seed=1
	cd fuzz && $(CARGO) +nightly fuzz run litdata_decode corpus/litdata_decode -- -max_total_time=$(FUZZ_SECONDS) -seed=1

fuzz-seeds:
	scripts/fuzz-seeds.sh

## The main job end to end on data it makes itself.
demo: toolchain
	scripts/demo.sh

## criterion benches, then the read benchmark table on the demo dataset.
bench:
	$(CARGO) bench -p granary
	scripts/demo.sh --bench-only
