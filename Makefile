# commlib: `make install` once, then `make demo` / `make test` / `make bench`.
SHELL := /bin/bash
export TF_CPP_MIN_LOG_LEVEL ?= 2
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
HOROVOD_VERSION := 0.28.1
HOROVOD_SRC := build/horovod-$(HOROVOD_VERSION)
NP ?= 4

.PHONY: install apt venv deps horovod develop keras3 demo test test-long fuzz bench bench-quick faults clean

install: apt venv deps horovod develop keras3

apt:
	@if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null || ! command -v cmake >/dev/null || \
	    ! command -v c++ >/dev/null || ! command -v ip >/dev/null || ! command -v tc >/dev/null || \
	    ! test -f /usr/include/openssl/evp.h; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    openmpi-bin libopenmpi-dev iproute2 build-essential cmake libssl-dev; fi

venv:
	@test -x $(PY) || python3 -m venv $(VENV)

# torch is pinned: an unpinned torch pulls GBs of CUDA packages. TF 2.15 is the newest
# horovod's TF ops build against, and it needs numpy < 2.
deps:
	$(PIP) install -q --upgrade "pip<25" setuptools wheel packaging
	$(PIP) install -q torch==2.13.0 tensorflow-cpu==2.15.1 numpy==1.26.4 cffi cryptography mpi4py \
	    pytest pytest-timeout matplotlib tqdm psutil cloudpickle pyyaml pytorch_lightning==2.6.6 atheris

# horovod 0.28.1 from its sdist (no wheel for Python 3.11), its C++14 raised to C++17, which PyTorch 2.x headers need.
horovod:
	@if $(PY) -c "import horovod.torch, horovod.tensorflow" 2>/dev/null; then echo "horovod already built"; else \
	  set -e; mkdir -p build; \
	  test -d $(HOROVOD_SRC) || { $(PIP) download -q --no-deps --no-binary :all: -d build horovod==$(HOROVOD_VERSION) \
	    && tar -xzf build/horovod-$(HOROVOD_VERSION).tar.gz -C build; }; \
	  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' $(HOROVOD_SRC)/CMakeLists.txt $(HOROVOD_SRC)/horovod/torch/CMakeLists.txt; \
	  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 \
	    MAKEFLAGS=-j2 $(PIP) install --no-build-isolation --no-cache-dir $(HOROVOD_SRC); \
	  $(PY) -c "import horovod.torch, horovod.tensorflow"; fi

develop:
	$(PIP) install -q --no-build-isolation -e .

# A second environment where Horovod's TF ops cannot go: the newest TF and Keras 3 (numpy 2), commlib
# on its own core (rank/size from the launcher, the ring through mpi4py or torch.distributed). The
# Keras 3 tests in `make test` run in it (tests/test_keras3.py); torch for Keras 3's torch backend.
KERAS3_VENV := .venv-keras3
keras3:
	@test -x $(KERAS3_VENV)/bin/python || python3 -m venv $(KERAS3_VENV)
	$(KERAS3_VENV)/bin/pip install -q --upgrade "pip<25" setuptools wheel
	$(KERAS3_VENV)/bin/pip install -q tensorflow-cpu==2.21.0 "keras>=3" torch==2.13.0 numpy cffi cryptography mpi4py \
	    pytest pytest-timeout
	$(KERAS3_VENV)/bin/pip install -q --no-build-isolation -e .

# The main job on the embedded default: 4 local workers, a local software switch, no configuration.
demo:
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo --gloo-timeout-seconds 120 $(PY) -m commlib.demo

# `make test`: every check but the fault, soak, scale and whole-example cases marked `long`, which
# `make test-long` runs (CI runs both; tests/README.md says what is where). Each lists its ten slowest
# cases: where CI's time goes.
test:
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 -m "not long" tests

test-long:
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 -m long tests

# The fuzz targets of tests/fuzz for FUZZ_SECONDS each, corpora kept in build/fuzz/corpus (`make test` runs
# them briefly through tests/test_fuzz.py). The packet targets run the ASan + UBSan build of the C code.
FUZZ_SECONDS ?= 300
fuzz:
	@set -e; for t in controller_hello switch_control aggregator_control switch_packets aggregator_packets; do \
	  mkdir -p build/fuzz/corpus/$$t build/fuzz/crashes; echo "== fuzz $$t ($(FUZZ_SECONDS)s)"; \
	  case $$t in *_packets) san=--sanitized;; *) san=;; esac; \
	  $(PY) tests/fuzz/run.py $$t $$san -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -artifact_prefix=build/fuzz/crashes/ build/fuzz/corpus/$$t 2>&1 | grep -v '^INFO: Instrumenting' | tail -20; \
	  test $${PIPESTATUS[0]} -eq 0; done

BENCH_ARGS ?=
bench:
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b $(BENCH_ARGS) || exit 1; done

bench-quick:
	$(MAKE) bench BENCH_ARGS=--quick

# switchml and omnireduce under loss, duplication, reordering and jitter (a user-space relay: no netem here)
faults:
	$(PY) benchmarks/faults.py $(FAULTS_ARGS)

clean:
	rm -rf build *.egg-info commlib/*.so switch/*.so
