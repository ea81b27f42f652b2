# The README's commands. Each one creates/refreshes .venv, installs the package with its
# compiled extension (lightning_amp._C), then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CPU machines take the local torch 2.13.0 CPU wheel; a machine that already has a torch in
# .venv (e.g. a CUDA build on a GPU machine) keeps it. setup.py adds the CUDA kernels when that
# torch is a CUDA build and nvcc is found (PATH or CUDA_HOME).
TORCH_SPEC ?= torch==2.13.0
LITGPT_VERSION := 0.5.13
STAMP  := $(VENV)/.lightning-amp-installed
SOURCES := setup.py pyproject.toml lightning_amp/ops/_build.py $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cuh csrc/cuda/*.h csrc/cuda/*.cpp)
PYTEST_ARGS ?=

# gpu-check: one command that proves this commit on the GPU present: build (for its compute capability,
# MAX_JOBS = cores), smoke, bench, optim, wgrad, cuda-tests, suite, in that order (PART=smoke,bench,...
# picks some; build always runs); report in GPU_CHECK_OUT, rewritten as each part ends.
# GPU_CHECK_BUDGET=seconds caps the whole invocation, build included (a part that cannot fit is
# reported NOT RUN). It runs with the python that holds torch: .venv's where there is one, else python3
# (the offline GPU machines'), and builds the extension in place (setup.py build_ext --inplace, no
# network). Without a GPU: says so, checks its own plumbing, exits 0. See docs/benchmarks.md. The tooling is
# the package gpu_check/ at the root, which no wheel holds; PYTHONPATH=$(CURDIR) imports it.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_OUT ?= gpu-check-out
GPU_CHECK_BUDGET ?=
PART ?=

.PHONY: install test test-fast test-slow test-post bench bench-docs pictures docs clean gpu-check

install: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q "setuptools>=77" wheel pybind11 ninja
	# --no-build-isolation: compile now, in place, against the torch in .venv (the development path; an
	# isolated install compiles nothing and builds at first import instead, see setup.py).
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	# litgpt (tests of tp_fused on its GPT) without its pins: they would downgrade transformers and
	# huggingface_hub; litgpt.model and litgpt.config need only torch and lightning. Offline (a GPU box)
	# its tests skip; under CI=true a missing litgpt fails them (tests/support/optional_deps.py).
	$(PY) -m pip install -q --no-deps "litgpt==$(LITGPT_VERSION)" || echo "litgpt not installed: its tests will skip"
	$(PY) -c "import lightning_amp.ops as o; print('lightning_amp backend: cpu', o.backend('cpu'), '/ cuda', o.backend('cuda'), '/', o.extension_origin())"
	touch $(STAMP)

# LIGHTNING_AMP_REQUIRE_EXT=1: a compiled extension that does not load (or lacks CUDA kernels on a
# GPU machine) fails the run instead of skipping every compiled-kernel test.
PYTEST := LIGHTNING_AMP_REQUIRE_EXT=1 $(PY) -m pytest -q

# test: the suite but the post-suite checks (under 15 minutes on 2 cores). test-fast: its tests not marked slow
# (minutes; every test module keeps some), test-slow: its others; the two lanes together are make test.
# test-post: the checks marked post_suite (the docs' blocks, the examples and the sdist's first-use build, each
# run as a user runs it, in fresh processes), which CI runs after the suite, cached (.ci/post-suite); make test
# and make test-post together are the whole suite (docs/architecture.md, Tests).
test: install
	$(PYTEST) -m "not post_suite" $(PYTEST_ARGS) tests

test-fast: install
	$(PYTEST) -m "not slow and not post_suite" $(PYTEST_ARGS) tests

test-slow: install
	$(PYTEST) -m "slow and not post_suite" $(PYTEST_ARGS) tests

test-post: install
	$(PYTEST) -m post_suite $(PYTEST_ARGS) tests

bench: install
	$(VENV)/bin/lightning-amp bench --out bench-out

# The published CPU table and chart: bench at this commit, then README.md, docs/benchmarks.md and
# docs/img/bench.png updated from bench-out/ (the prose around the table is for a person to reread).
bench-docs: install
	$(VENV)/bin/lightning-amp bench --accelerator cpu --out bench-out
	$(PY) benchmarks/publish_bench.py bench-out

# The docs' pictures (docs/img/ladder-run.png, loss-scale-run.png, tp-split-llama-block.png) drawn from seeded CPU
# runs at this commit (about 30 s on 2 cores; the commit is in each picture's footer). See benchmarks/draw_pictures.py.
pictures: install
	$(PY) benchmarks/draw_pictures.py --out docs/img

gpu-check:
	@$(GPU_PY) -c "import torch" 2>/dev/null || { echo "gpu-check: $(GPU_PY) has no torch; run make install or set GPU_PY"; exit 2; }
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m gpu_check --out "$(GPU_CHECK_OUT)" $(if $(PART),--part "$(PART)") $(if $(GPU_CHECK_BUDGET),--budget $(GPU_CHECK_BUDGET))

docs: install
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf build *.egg-info lightning_amp/*.so $(STAMP)
