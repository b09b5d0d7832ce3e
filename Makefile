# Two commands: `make lab` (set up, open the course in JupyterLab) and `make test` (set up, run every test).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.amp-lessons-installed
HOST   ?= 127.0.0.1
PORT   ?= 8888
# Jupyter refuses to run as root unless told; containers and CI machines often are root.
ROOT_OK := $(if $(filter 0,$(shell id -u)),--allow-root,)
NBVAL  := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: lab test unit notebooks browser clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[lab,test]'
	@touch $(STAMP)

# JupyterLab on localhost only, token authentication left on (the URL with the token is printed).
lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_OK) --ServerApp.ip=$(HOST) --ServerApp.port=$(PORT) \
		--ServerApp.root_dir=notebooks --ServerApp.open_browser=$${OPEN_BROWSER:-True}

test: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not browser"
	AMP_LESSONS_PROFILE=quick $(BIN)/python -m pytest -q $(NBVAL) notebooks
	$(BIN)/python -m pytest -q tests -m browser -rs

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not browser"

notebooks: $(STAMP)
	AMP_LESSONS_PROFILE=quick $(BIN)/python -m pytest -q $(NBVAL) notebooks

browser: $(STAMP)
	$(BIN)/python -m pytest -q tests -m browser -rs

clean:
	rm -rf $(VENV) .pytest_cache test-output
