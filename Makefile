# `make demo` and `make test` set up .venv themselves on a fresh machine.
# torch==2.13.0 goes in first: on this machine kind it is a local CPU build, and
# installing it first stops pip from pulling a CUDA build for the `torch` range.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench bench-comm clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,serve,profile]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m launch.demo

test: $(STAMP)
	$(PY) -m pytest -q tests

$(VENV)/.bench: $(STAMP)
	$(PY) -m pip install -q -e ".[test,serve,profile,bench]"
	touch $@

bench: $(VENV)/.bench
	$(PY) bench/throughput.py
	$(PY) bench/step_breakdown.py
	$(PY) bench/deepspeed_moe.py
	$(PY) bench/balancer.py
	$(PY) bench/serve_load.py
	$(PY) bench/kernels.py

# needs root: network namespaces, a veth pair and tc (see the README's comm modes section)
bench-comm: $(VENV)/.bench
	$(PY) bench/comm_emulated.py

clean:
	rm -rf $(VENV)
