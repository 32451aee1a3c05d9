# The two commands of the README. Each creates .venv when it is missing (CPU torch).
VENV  ?= .venv
PY    := $(VENV)/bin/python
# A CPU build that installs fast; on a GPU box create the venv yourself with a CUDA torch.
TORCH ?= torch==2.13.0

.PHONY: demo test lint docs venv sglang-cpu

venv: $(VENV)/.installed

# Built once (a few minutes: CPU torch and the dependencies are downloaded); each step says so.
$(VENV)/.installed: pyproject.toml
	@echo "== creating $(VENV) (once; a few minutes): 1/3 Python venv + pip"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "== 2/3 $(TORCH) (the largest download)"
	@$(PY) -m pip install --progress-bar on "$(TORCH)"
	@echo "== 3/3 megarl and its dependencies (Megatron-core, Ray, transformers, ...)"
	@$(PY) -m pip install --progress-bar on -e ".[dev]"
	@echo "== $(VENV) is ready"
	@touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/megarl demo

# The unit tests mostly wait (on child processes, deadlines, files): three at a time keep 2 cores
# busy. The multi-process tests (gloo ranks, Ray runs, SGLang servers) each use both cores: one by one.
# Both parts run whatever the first gives; make fails if either failed.
test: $(VENV)/.installed
	@echo "== running the test suite (about an hour on 2 cores): 1/2 the unit tests, three at a time"
	@rc=0; \
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 3 --durations=15 tests/unit || rc=$$?; \
	echo "== 2/2 the multi-process and end-to-end tests, one at a time (the 15 slowest of each part are listed)"; \
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest --durations=15 --ignore=tests/unit || rc=$$?; \
	exit $$rc

# ruff; the dead-code check: a function, class or attribute nothing uses fails CI
# (ci/vulture_whitelist.py lists the names used by name: registries, pydantic, Megatron); the
# import contracts (the layers of docs/architecture.md, in pyproject.toml); the type check; the
# documentation site built strictly (a broken link or anchor, or a page outside mkdocs.yml's nav, fails).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check megarl tests bench docs ci
	$(VENV)/bin/vulture megarl bench docs/examples docs/site_pages.py ci/vulture_whitelist.py --min-confidence 60
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy megarl
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The documentation site (docs/, mkdocs.yml) into site/: open site/index.html. The reference pages
# (configuration, commands, metrics, benchmark results) are generated from the code as it builds.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "site/index.html"

# The real SGLang server on CPU, for tests/sglang/ (skipped without it): a separate venv built
# from ci/sglang-cpu/requirements.lock outside the checkout (the path ci/sglang-cpu/venv_path.py
# prints); a few minutes and about 3 GB the first time, then reused.
sglang-cpu:
	bash ci/sglang-cpu/build-venv.sh

# Hugging Face TRL (its GRPOTrainer) for bench/vs_trl.py, in a venv of its own outside the checkout,
# named by the hash of ci/trl/requirements.lock; bench/vs_trl.py builds it too when missing.
.PHONY: trl-venv
trl-venv:
	bash ci/trl/build-venv.sh

# megatron-core 0.19 (what Python 3.12 clusters install) in a venv of its own, outside the
# checkout: ci/mcore-latest/build-venv.sh builds it once per hash of its lock file and
# pyproject.toml under $(MEGARL_CACHE). The checkout's megarl comes from PYTHONPATH.
MEGARL_CACHE ?= $(HOME)/.cache/megarl
MCORE_LATEST_TESTS ?= tests/distributed tests/unit/parallel tests/unit/test_lazy_compile.py \
	tests/e2e/test_trainer.py::test_grpo_three_steps \
	tests/e2e/test_trainer.py::test_ppo_with_critic_two_steps \
	'tests/e2e/test_convert_formats.py::test_hf_to_megatron_tp2_pp2_and_back_bit_for_bit[qwen2]' \
	tests/e2e/test_convert_moe.py \
	tests/e2e/test_convert_deepseek_v3.py

.PHONY: test-mcore-latest
test-mcore-latest:
	@venv="$$(MEGARL_CACHE=$(MEGARL_CACHE) bash ci/mcore-latest/build-venv.sh)" && \
	export PYTHONPATH="$(CURDIR)" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 && \
	"$$venv/bin/python" ci/mcore-latest/check_env.py "$(CURDIR)" && \
	"$$venv/bin/python" -m pytest -p no:cacheprovider --durations=10 $(MCORE_LATEST_TESTS)
