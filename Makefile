# Thin targets. The two that matter: `make serve` and `make test` (see README.md).
#   make serve [MODEL=/path/model.pth] [STRATEGY="albatross workers=1 batch=32"] [PORT=8000] [HOST=127.0.0.1] [PASSWORD=...]
#   make test

PYTHON ?= python3
VENV := .venv
PY := $(CURDIR)/$(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
STRATEGY ?=
PASSWORD ?=
BENCH ?= bench_model
DEMO_MODEL := $(CURDIR)/models/rwkv7-demo-tiny.pth
MODEL_PATH := $(if $(MODEL),$(abspath $(MODEL)),$(DEMO_MODEL))

.PHONY: serve test lint deps test-deps demo-model frontend frontend-test bench kernels

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch: keep whatever build is already there (a GPU image brings its own); else the pinned wheel.
# pip shows its own progress (downloads, builds); a line before each long step says what runs.
PIP := $(PY) -m pip install --disable-pip-version-check --progress-bar on
$(VENV)/.deps: backend-python/requirements.txt | $(PY)
	@echo "==> installing the Python dependencies into $(VENV) (first run: a few minutes)"
	$(PIP) -r backend-python/requirements.txt
	@$(PY) -c "import torch" 2>/dev/null || { echo "==> installing torch 2.13.0 (CPU wheel, ~200 MB)"; $(PIP) torch==2.13.0; }
	@touch $@

$(VENV)/.test-deps: backend-python/requirements-test.txt $(VENV)/.deps
	@echo "==> installing the test dependencies"
	$(PIP) -r backend-python/requirements-test.txt
	@touch $@

deps: $(VENV)/.deps
test-deps: $(VENV)/.test-deps

$(DEMO_MODEL): | $(VENV)/.deps
	@echo "==> writing the demo model (random weights) to $(DEMO_MODEL)"
	cd backend-python && $(PY) -m albatross.random_checkpoint --shape tiny --output $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)

# Build the web GUI once when it is missing; without npm the API is served alone.
frontend:
	@if [ ! -f frontend/package.json ]; then echo "no frontend/: API only"; \
	elif [ -f frontend/dist/index.html ]; then echo "web GUI already built (frontend/dist)"; \
	elif ! command -v npm >/dev/null 2>&1; then echo "npm not found: skipping the web GUI build (API only)"; \
	else echo "==> building the web GUI (npm ci, then vite build; first run: a minute or two)"; \
	(cd frontend && npm ci --no-audit --no-fund --progress=true && npm run build); fi

serve: deps frontend $(if $(MODEL),,demo-model)
	cd backend-python && exec $(PY) main.py --host $(HOST) --port $(PORT) \
		--model-path "$(MODEL_PATH)" --models-dir "$(CURDIR)/models" \
		$(if $(STRATEGY),--strategy "$(STRATEGY)") $(if $(PASSWORD),--password "$(PASSWORD)") \
		$$([ -f ../frontend/dist/index.html ] && echo --webui)

# Unit tests (vitest), then the browser tests: Debian's Chromium driven by playwright-core against
# real backends serving a tiny model (.ci/run installs Chromium when it is missing).
frontend-test: $(VENV)/.test-deps
	cd frontend && npm ci --no-audit --no-fund && npm test && PYTHON=$(PY) npm run test:browser

# ruff (backend-python/ruff.toml) and mypy (backend-python/mypy.ini): a finding stops the target.
lint: test-deps
	cd backend-python && $(PY) -m ruff check . && $(PY) -m mypy

# Lint first (a finding stops the target). Then both suites run whatever the other's result (a
# failing pytest must not hide the frontend's state), and the target fails when either does.
# pytest exits non-zero when a test fails and 5 when it collected none: both count as a failure.
test: test-deps
	$(MAKE) --no-print-directory lint
	@failed=""; \
	(cd backend-python && $(PY) -m pytest -q) || failed="$$failed backend(pytest)"; \
	$(MAKE) --no-print-directory frontend-test || failed="$$failed frontend"; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed"; exit 1; fi; \
	echo "make test: backend and frontend tests passed"

bench: deps
	cd backend-python && $(PY) -m bench.$(BENCH) $(ARGS)

kernels: deps
	$(PY) build_kernels.py $(ARGS)
