# The two commands of the README. Each creates .venv when it is missing (CPU torch).
VENV  ?= .venv
PY    := $(VENV)/bin/python
# A CPU build that installs fast; on a GPU box create the venv yourself with a CUDA torch.
TORCH ?= torch==2.13.0

.PHONY: demo test lint venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/megarl demo

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest --durations=15

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check megarl tests bench
