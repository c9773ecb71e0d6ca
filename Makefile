# Two commands do all set-up on a fresh machine:
#   make figures   create .venv, install, run the main job (quick mode, CPU)
#   make test      create .venv if missing, install, run the test suite
#   make heavy     the paper-size and kill-at-random checks make test leaves out
#                  (CI runs them after make test)
#   make gpu       bench/gpu.py: one table on one GPU (about 4-5 minutes on an H100;
#                  says so and exits 0 where torch sees no GPU; --out gpu.md)
#   make browser   the browser test: the notebooks in JupyterLab in headless
#                  Chromium, offline (needs chromium: apt-get install chromium);
#                  CI runs it after make test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/pip install -q --disable-pip-version-check
OUT    ?= figures

.PHONY: figures test heavy test-all browser bench gpu clean-venv

$(STAMP): pyproject.toml Makefile
	@# A machine that already has a CUDA build of torch keeps it: the venv sees
	@# the system site-packages. Elsewhere the CPU build 2.13.0 is installed.
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	  echo "setup: reusing the system's CUDA build of torch"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV); \
	  $(PIP) --no-compile "torch==2.13.0" || $(PIP) --no-compile "torch>=2.1"; \
	fi
	@# uv resolves and installs the rest in seconds where pip takes minutes; pip
	@# stays the fallback. uv runs only where torch is already in the venv's own
	@# site-packages, so it can never replace a system CUDA build with a wheel.
	@if $(BIN)/python -c "import torch, sys; sys.exit(0 if torch.__file__.startswith(sys.prefix) else 1)" 2>/dev/null \
	    && $(PIP) uv; then \
	  $(BIN)/uv pip install -q --python $(BIN)/python -e ".[dev,notebooks]" || $(PIP) -e ".[dev,notebooks]"; \
	else \
	  $(PIP) -e ".[dev,notebooks]"; \
	fi
	@# notebooks run and saved in place are committed without their outputs (.gitattributes);
	@# git keeps filter settings per clone, so each clone registers it here
	@if git rev-parse --git-dir >/dev/null 2>&1; then $(PYTHON) scripts/strip_notebook.py --install; fi
	@# torch goes in without bytecode (pip --no-compile), and where PYTHONDONTWRITEBYTECODE
	@# is set no import writes it: every test worker, kernel and CLI run would compile
	@# torch again (3 s of CPU each). Written once here (the venv's and the checkout's
	@# __pycache__, which git ignores)
	@$(BIN)/python scripts/warm_bytecode.py
	@touch $@

figures: $(STAMP)
	$(BIN)/harmony reproduce --quick --out $(OUT)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist worksteal

heavy: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m heavy

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m ""

browser: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 -m browser tests/test_browser.py

bench: $(STAMP)
	$(BIN)/python bench/swap_volume.py
	$(BIN)/python bench/search_speed.py

gpu: $(STAMP)
	$(BIN)/python bench/gpu.py --out gpu.md

clean-venv:
	rm -rf $(VENV)
