# Two commands: `make lab` (set up, open the course in JupyterLab) and `make test` (set up, run every test).
# Optional: `make torchao` adds torchao (float8 training, low-bit optimizers) to the same venv.
PYTHON ?= python3
# CPU=1: PyTorch's CPU-only wheels (see below), in a venv of their own, so that neither set-up
# ever finds the other's torch already installed (CPU=0 or no CPU: the default set-up).
CPU_ONLY := $(filter-out 0 no false,$(CPU))
VENV   ?= $(if $(CPU_ONLY),.venv-cpu,.venv)
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.amp-lessons-installed
HOST   ?= 127.0.0.1
PORT   ?= 8888
# Jupyter refuses to run as root unless told; containers and CI machines often are root.
ROOT_OK := $(if $(filter 0,$(shell id -u)),--allow-root,)
# (a kernel start may take long on a machine busy with three test sessions; conftest.py retries it)
NBVAL  := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
	--nbval-kernel-startup-timeout 120

# Colab's own widget and plotly versions (no anywidget): a second, small venv that reuses .venv's
# torch and test tools and overrides only the packages pinned in tests/colab_versions.txt.
COLAB_VENV := $(VENV)-colab
COLAB_PINS := -r tests/colab_versions.txt
COLAB_STAMP := $(COLAB_VENV)/.amp-lessons-colab
# python3.X: the folder name of a venv's site-packages (asked once: each make reads it)
PY_XY := python$(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
COLAB_SITE := $(COLAB_VENV)/lib/$(PY_XY)/site-packages

# The oldest torch the package supports (pyproject.toml: torch>=2.4), pinned in
# tests/oldest_versions.txt: a third venv with only that torch and torchvision (and what they
# need); everything else comes from .venv through a .pth file, as for the Colab venv.
OLDEST_VENV := $(VENV)-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.amp-lessons-oldest
OLDEST_SITE := $(OLDEST_VENV)/lib/$(PY_XY)/site-packages
# The tests whose subject changes between torch releases: GradScaler's internals and the
# trainer's policies, autocast, float8 formats, checkpointing (SAC), launching, DDP and FSDP2,
# checkpoint files. `make test-oldest OLDEST_TESTS=tests` runs every unit test there.
OLDEST_TESTS ?= tests/test_policies.py tests/test_trainer.py \
	tests/test_precision.py tests/test_formats.py tests/test_models_resnet.py \
	tests/test_distributed.py tests/test_checkpoint.py tests/test_trainer_other_models.py \
	tests/test_trainer_fit_resume.py

.PHONY: lab test venvs test-oldest unit notebooks browser colab colab-workers figure-images screenshot claims \
	torchao clean

# CPU=1 (`make lab CPU=1`, and CPU=1 on every later target: `make test CPU=1`): a machine without
# an NVIDIA GPU. torch and torchvision at the pinned versions come from PyTorch's CPU-only wheel
# index into .venv-cpu; the rest as usual (the `+cpu` build satisfies the `torch==` pin, so pip
# keeps it and the nvidia-* pins go unused). The default, PyPI's torch, brings the CUDA libraries.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_PINS := $(shell grep -E '^(torch|torchvision)==' constraints.txt)
CHECK_CPU_TORCH = $(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda and \
	'$(VENV) holds a CUDA build of torch (' + torch.__version__ + '), not the CPU-only one')"

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(CPU_ONLY),$(BIN)/python -m pip install -q --no-deps --index-url $(TORCH_CPU_INDEX) $(TORCH_PINS))
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[lab,test]'
	$(if $(CPU_ONLY),$(CHECK_CPU_TORCH))
	@touch $(STAMP)

# The optional torchao extra (lesson 07's FP8 training on an FP8 GPU; low-bit optimizers), pinned.
torchao: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[torchao]'

# JupyterLab on localhost only, token authentication left on (the URL with the token is printed).
# A browser opens where there is a display to show it (DISPLAY or WAYLAND_DISPLAY set, macOS,
# Windows); on a server or in a container JupyterLab only prints the URL, without its "No web
# browser found" attempt. `make lab OPEN_BROWSER=True` (or False) decides instead.
OPEN_BROWSER ?= $(if $(DISPLAY)$(WAYLAND_DISPLAY)$(filter Windows_NT,$(OS))$(filter Darwin,$(shell uname -s 2>/dev/null)),True,False)
lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_OK) --ServerApp.ip=$(HOST) --ServerApp.port=$(PORT) \
		--ServerApp.root_dir=notebooks --ServerApp.open_browser=$(OPEN_BROWSER)

# The unit tests and the notebooks run in JOBS pytest-xdist workers (`auto`: one per core), each
# torch on one thread (OMP_NUM_THREADS=1: two workers of two threads each thrash a 2-core CI
# machine); the tests marked `serial` (they assert on wall time) run alone after them. `--dist
# loadscope` keeps each notebook's cells in order on one worker. JOBS=0: everything in one process.
JOBS   ?= auto
XDIST  := $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS))
NB_XDIST := $(XDIST) $(if $(filter 0,$(JOBS)),,--dist loadscope)
UNIT   := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests -m "not browser and not serial" $(XDIST)
SERIAL := $(BIN)/python -m pytest -q tests -m "serial and not browser"
# AMP_LESSONS_REQUIRE_PROVENANCE=1: a notebook that publishes a row no traced call made fails
# (publish.provenance): every published number leads back to the function that produced it.
# AMP_LESSONS_TIMED_ALONE: whether the run's times (build/notebook-times) were taken alone; `make
# test` shares the machine with two other sessions (SHARED=1), so its times state nothing.
NOTEBOOKS := AMP_LESSONS_PROFILE=quick AMP_LESSONS_REQUIRE_PROVENANCE=1 OMP_NUM_THREADS=1 \
	AMP_LESSONS_TIMED_ALONE=$(if $(SHARED),0,1) $(BIN)/python -m pytest -q $(NBVAL) $(NB_XDIST) notebooks
BROWSER := $(BIN)/python -m pytest -q tests -m browser -rs

# `make test` runs what `make unit`, `make notebooks`, `make browser`, `make colab` and `make
# test-oldest` run. What times itself runs alone: the tests marked `serial` and the browser tests
# in one process, one at a time (tests/conftest.py runs the serial ones first; that process
# collects only the test files that name either mark), then Colab's serial tests. The rest runs
# in pytest-xdist workers: the unit tests, then the notebooks, Colab's workers and the oldest
# torch's at once (three sessions side by side fill each other's idle time: a worker waiting on
# its last notebook or on a launched process; each session's output is shown when it ends). The
# course's own modules are byte-compiled first: where PYTHONDONTWRITEBYTECODE is set, every
# process of the run (workers, kernels, launched ranks) would otherwise compile them again.
# .venv-oldest is needed only by the last stage: it is built in the background at the lowest CPU
# priority (nice 19) from the start, on the time the stages before leave idle (one core of the
# serial and browser tests), and waited for before the last stage; its log is in
# build/oldest-venv.log. Built beside .venv at equal priority it lengthened the set-up instead.
# (flock, where there is one, keeps a second `make test` from building the same venv at once.)
OUTPUT_SYNC := $(if $(filter output-sync,$(.FEATURES)),--output-sync=target)
OLDEST_LOG := build/oldest-venv.log
FLOCK := $(if $(shell command -v flock 2>/dev/null),flock build/oldest-venv.lock)
test:
	@mkdir -p build && rm -f $(OLDEST_LOG).status && \
		( $(FLOCK) nice -n 19 $(MAKE) --no-print-directory $(OLDEST_STAMP) > $(OLDEST_LOG) 2>&1; \
		  echo $$? > $(OLDEST_LOG).status ) &
	@$(MAKE) --no-print-directory venvs
	@$(BIN)/python -m compileall -q amp_lessons tests > /dev/null || true
	$(UNIT)
	$(BIN)/python -m pytest -q tests -m "serial or browser" -rs
	$(COLAB_SERIAL)
	@while [ ! -f $(OLDEST_LOG).status ]; do sleep 2; done; \
		if [ "$$(cat $(OLDEST_LOG).status)" != 0 ]; then cat $(OLDEST_LOG); \
		echo "make test: building $(OLDEST_VENV) failed (log above)" >&2; exit 1; fi
	@$(MAKE) --no-print-directory -j3 $(OUTPUT_SYNC) notebooks colab-workers test-oldest SHARED=1

# .venv and .venv-colab at once, without -j on the command line (a sub-make with -j2); `make
# test` builds .venv-oldest beside them in the background (above), at the lowest priority.
venvs:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(COLAB_STAMP)

# (not after $(STAMP): `make test` builds the three venvs at once; the .pth names .venv's path)
$(COLAB_STAMP): Makefile tests/colab_versions.txt
	@test -x $(COLAB_VENV)/bin/python || $(PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install -q --no-deps $(COLAB_PINS)
	@for pkg in anywidget kaleido; do mkdir -p $(COLAB_SITE)/$$pkg; \
		echo "raise ImportError('$$pkg is not installed (as on Colab)')" > $(COLAB_SITE)/$$pkg/__init__.py; done
	@printf '%s\n%s\n' "$(abspath $(VENV))/lib/$(notdir $(patsubst %/site-packages,%,$(COLAB_SITE)))/site-packages" \
		"$(CURDIR)" > $(COLAB_SITE)/zz_amp_lessons_main_venv.pth
	@touch $(COLAB_STAMP)

# The widget and figure tests and lessons 01 and 03 under Colab's ipywidgets 7 / plotly 5, without
# anywidget: the unit tests and the notebooks in one set of workers (--dist loadscope: a test file
# or a notebook to a worker; on a CPU the unit tests' profile is quick either way), then the
# serial ones alone.
COLAB_TESTS := tests/test_controls.py tests/test_widgets.py tests/test_plots.py tests/test_lesson01.py \
	tests/test_lesson03.py
COLAB_NOTEBOOKS := notebooks/01_fp16_ranges_and_underflow.ipynb notebooks/03_grad_scaler_tuning.ipynb
COLAB_SERIAL = $(COLAB_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "serial and not browser" \
	$(COLAB_TESTS)
colab: colab-workers
	$(COLAB_SERIAL)

colab-workers: $(STAMP) $(COLAB_STAMP)
	AMP_LESSONS_PROFILE=quick AMP_LESSONS_REQUIRE_PROVENANCE=1 OMP_NUM_THREADS=1 AMP_LESSONS_TIMED_ALONE=0 \
		$(COLAB_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		-m "not browser and not serial" $(NBVAL) $(NB_XDIST) $(COLAB_NOTEBOOKS) $(COLAB_TESTS)

# (not after $(STAMP): `make test` builds the three venvs at once; the .pth names .venv's path)
$(OLDEST_STAMP): Makefile tests/oldest_versions.txt
	@test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q $(if $(CPU_ONLY),--index-url $(TORCH_CPU_INDEX)) \
		-r tests/oldest_versions.txt
	@printf '%s\n%s\n' "$(abspath $(VENV))/lib/$(notdir $(patsubst %/site-packages,%,$(OLDEST_SITE)))/site-packages" \
		"$(CURDIR)" > $(OLDEST_SITE)/zz_amp_lessons_main_venv.pth
	@touch $(OLDEST_STAMP)

# The version-sensitive tests again on the oldest supported torch (2.4.1): `make test` runs it.
test-oldest: $(STAMP) $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	OMP_NUM_THREADS=1 $(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not browser and not serial" \
		$(XDIST) $(OLDEST_TESTS)

# Static PNGs beside every figure of the committed notebooks (needs Chromium), after a GPU run.
figure-images: $(STAMP)
	$(BIN)/python -m amp_lessons figure-images

# The README's screenshot of lesson 03's panel, taken by the browser test into test-output/.
screenshot: $(STAMP)
	AMP_LESSONS_UPDATE_IMAGES=1 $(BIN)/python -m pytest -q tests/test_browser.py -m browser -k test_lesson03_panel_in_jupyterlab

claims: $(STAMP)
	$(BIN)/python -m amp_lessons claims --out docs/claims.md

unit: $(STAMP)
	$(UNIT)
	$(SERIAL)

notebooks: $(STAMP)
	$(NOTEBOOKS)

browser: $(STAMP)
	$(BROWSER)

clean:
	rm -rf $(sort $(VENV) $(COLAB_VENV) $(OLDEST_VENV) .venv .venv-colab .venv-cpu .venv-cpu-colab \
		.venv-oldest .venv-cpu-oldest) .pytest_cache test-output
