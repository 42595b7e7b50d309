# Two commands do everything on a fresh machine:  make demo  and  make test.
PYTHON_BOOT ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hvd_edl-deps
# each set-up step shows what it installs or builds, with elapsed time; whole logs in build/
PROGRESS = $(PY) cmake/progress.py
PYTEST_ARGS ?=
# make test's tests run on this many pytest-xdist workers (tests/conftest.py says why two)
TEST_JOBS ?= 2

.PHONY: setup setup-build demo test bench scale chaos clean install

# One install every user of a team's head host runs (docs/cluster.md, "A team's head host"):
#   sudo make install PREFIX=/opt/hvd-edl PYTHON_BOOT=/usr/bin/python3
# from a checkout of its own that every user can read (e.g. /opt/hvd-edl-src: its build/ is
# this install's), with a Python every user can run (not one under a 0700 home, as pyenv's in
# /root: its venvs fail with "bad interpreter" for everybody else)
PREFIX ?= /opt/hvd-edl

HOROVOD_VERSION := $(shell sed -n 's/.*HVD_EDL_HOROVOD_VERSION "\([0-9.]*\)".*/\1/p' CMakeLists.txt)

# A second run is one line: when the installed Horovod already matches what the build would make
# (cmake/horovod_matches.py: version, this torch, the GPU choice now, the patch set: the build's
# own check, about 2-4 s) and build/check-build.txt shows PyTorch, cmake and horovodrun's 10 s
# table are skipped.
setup: $(STAMP)
	@if $(PY) cmake/horovod_matches.py $(HOROVOD_VERSION) > /dev/null 2>&1 \
	    && grep -q '\[X\] PyTorch' build/check-build.txt 2> /dev/null; then \
	  echo "set-up ok: nothing to do (Horovod $(HOROVOD_VERSION) already built against this torch; $(STAMP) current)"; \
	else $(MAKE) --no-print-directory setup-build VENV=$(VENV) PYTHON_BOOT=$(PYTHON_BOOT); fi

setup-build: $(STAMP)
	@cmake -S . -B build -DPython3_EXECUTABLE=$(abspath $(PY)) > build.cmake.log 2>&1 || (cat build.cmake.log; exit 1)
	@$(PROGRESS) "building Horovod against the installed torch (built once: minutes on 2 cores)" \
	  --log build/horovod-build.log -- cmake --build build
	@$(VENV)/bin/horovodrun --check-build > build/check-build.txt 2>&1; grep -q '\[X\] PyTorch' build/check-build.txt || (cat build/check-build.txt; echo "Horovod lacks PyTorch"; exit 1)
	@echo "set-up ok: $$($(PY) -c 'import torch, horovod; print("torch", torch.__version__, "horovod", horovod.__version__)')"
	@$(PY) cmake/detect_gpu.py --built

$(STAMP): requirements.txt setup.py
	@test -x $(PY) || (echo "set-up: creating $(VENV) ($(PYTHON_BOOT) -m venv)" && $(PYTHON_BOOT) -m venv $(VENV))
	@mkdir -p build
	@$(PROGRESS) "upgrading pip" --log build/setup-pip.log -- $(PY) -m pip install --upgrade pip \
	  || echo "set-up: pip not upgraded; going on with $$($(PY) -m pip --version)"
	@$(PROGRESS) "installing requirements.txt (torch, mpich, ...: the first time takes minutes)" \
	  --log build/setup-requirements.log -- $(PY) -m pip install -r requirements.txt
	@$(PROGRESS) "installing hvd_edl itself (editable)" --log build/setup-hvd_edl.log -- \
	  $(PY) -m pip install --no-deps --no-build-isolation -e .
	@$(PY) -c "import torch, sklearn, requests, filelock, psutil, tqdm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

# The main job, elastic: host discovery follows a timetable (2 workers, then 4, then 1, then 3;
# each phase counted from when the job reached the size before, per the event log).
DEMO_CLOCK := build/demo-clock
demo: setup
	@rm -f $(DEMO_CLOCK) build/demo-events.jsonl
	$(VENV)/bin/hvd-edl-run -np 2 --min-np 1 --max-np 4 --event-log build/demo-events.jsonl \
	  --host-discovery-script "$(VENV)/bin/python examples/discover_timetable.py --schedule 0:2,8:4,18:1,26:3 --clock $(DEMO_CLOCK) --event-log build/demo-events.jsonl" \
	  $(VENV)/bin/python examples/train_digits.py --epochs 40 --step-delay 0.02 --summary build/demo-summary.json

test: setup
	$(VENV)/bin/python -m pytest -n $(TEST_JOBS) --dist loadgroup $(PYTEST_ARGS) tests

# The variations left out of make test (marker long: several minutes, one at a time), then nothing else.
test-long: setup
	$(VENV)/bin/python -m pytest -m long $(PYTEST_ARGS) tests

# hvd_edl vs Horovod Elastic vs static Horovod (about 15 minutes on 2 cores): benchmarks/results/
bench: setup
	$(VENV)/bin/python benchmarks/job/bench.py

# Switch cost at 2, 4, 8, 16 workers, hvd_edl vs Horovod Elastic (scale.py, about 10 minutes),
# then the simulated control plane at 64-1,024 workers (control_plane.py, 5-15 minutes): 15-25
# minutes on 2 cores in all (docs/benchmarks.md); benchmarks/results/scale.json and scale.png
scale: setup
	$(VENV)/bin/python benchmarks/job/scale.py
	$(VENV)/bin/python benchmarks/job/control_plane.py
	$(VENV)/bin/python benchmarks/job/scale.py --plot-only

# Seeded random faults over the digits job (3 runs x 10 faults, about 2 minutes).
chaos: setup
	$(VENV)/bin/python -m pytest -m chaos -s $(PYTEST_ARGS) tests/test_chaos.py

install:
	$(MAKE) setup VENV=$(PREFIX) PYTHON_BOOT=$(PYTHON_BOOT)
	chmod -R a+rX $(PREFIX) $(CURDIR)
	@echo "installed for every user: PATH=$(PREFIX)/bin:\$$PATH (e.g. in /etc/profile.d/hvd-edl.sh)"

clean:
	rm -rf build build.cmake.log
