# notify-outbox developer commands. `make test` works on a fresh machine: it creates the
# virtualenv, installs everything, and the tests start their own PostgreSQL and Kafka.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: install test test-faults unit lint docs docs-reference schema dist-check k8s-check demo example bench bench-smoke stack-up stack-down clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# The whole suite against a real PostgreSQL and a real Kafka broker (started automatically;
# see docs/contributing.md), as two pytest sessions side by side, each with its own local stack
# and --basetemp: the fault suite and the bench's smoke tests (tests/faults, which stops and
# restarts its services, and tests/bench), and everything else. Their tests mostly wait on
# servers and processes, so on 2 cores the two take little longer than the longer one alone.
# The first session's output follows the second's. Then, on their own, the tests marked
# `cluster` (a three-broker Kafka cluster: three JVMs that, beside both sessions, slowed the
# timing-sensitive tests into failing). pytest's exit code 5 (no tests collected) is a failure
# here too. --durations=20: each session's 20 slowest tests, at its end.
test: $(STAMP)
	@set -u; log=$$(mktemp); tmp=$$(mktemp -d); \
	$(PY) -m pytest tests/faults tests/bench -m "not cluster" --durations=20 --basetemp="$$tmp/a" \
		$(PYTEST_ARGS) >"$$log" 2>&1 & first=$$!; \
	trap 'kill $$first 2>/dev/null' INT TERM; \
	$(PY) -m pytest --ignore=tests/faults --ignore=tests/bench -m "not cluster" --durations=20 \
		--basetemp="$$tmp/b" $(PYTEST_ARGS); rc=$$?; \
	wait $$first; frc=$$?; \
	echo "== tests/faults and tests/bench, run beside the tests above"; cat "$$log"; \
	echo "== three-broker Kafka clusters (marked cluster), on their own: three JVMs each"; \
	$(PY) -m pytest tests -m cluster --durations=5 --basetemp="$$tmp/c" $(PYTEST_ARGS); crc=$$?; \
	rm -rf "$$log" "$$tmp"; \
	for code in $$rc $$frc $$crc; do \
		if [ $$code -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; \
	done; \
	if [ $$rc -ne 0 ] || [ $$frc -ne 0 ] || [ $$crc -ne 0 ]; then \
		echo "make test: pytest exited $$rc (the rest), $$frc (tests/faults, tests/bench)," \
			"$$crc (clusters)" >&2; exit 1; fi

# Only the fault-injection suite (part of `make test` too; ~5 min): crashes, restarts, outages.
# Its own --basetemp, so it can run beside another pytest session of the same user.
test-faults: $(STAMP)
	$(PY) -m pytest tests/faults -p no:cacheprovider --basetemp=/tmp/notify-outbox-faults-$$$$

# The unit tests, and the fake store's half of the stores' contract suite (tests/contract; the
# PostgreSQL half is marked integration).
unit: $(STAMP)
	$(PY) -m pytest tests/unit tests/contract -m "not integration" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --strict notify_outbox devstack tools bench examples

# The docs site (mkdocs.yml, docs/) into site/, strictly: any warning (a broken link or anchor,
# a page missing from the nav) fails. It regenerates nothing: generated references that drifted
# from the code fail here too; `make docs-reference` rewrites them.
docs: $(STAMP)
	$(PY) -m tools.docgen --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean -d site

# docs/reference/configuration.md and cli.md, from OutboxSettings and the command line's parser;
# the headline figures of README.md and docs/benchmarks.md, from bench/results/.
docs-reference: $(STAMP)
	$(PY) -m tools.docgen
	$(PY) -m bench.figures

# sql/schema.sql and sql/inbox_schema.sql from the migrations (a throwaway local PostgreSQL, or
# NOTIFY_OUTBOX_TEST_DSN's); tests/integration/test_schema.py proves them equal.
schema: $(STAMP)
	$(PY) -m tools.schema

# The release artefacts as a user gets them: the sdist and the wheel built by `python -m build`
# (the wheel from the sdist, so a file missing from the sdist fails here), their metadata
# checked by twine, the wheel installed into a fresh virtualenv, and its `notify-outbox
# --version` compared with notify_outbox.__version__. Everything in a temporary directory.
dist-check: $(STAMP)
	@set -euo pipefail; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	want="notify-outbox $$($(PY) -c 'import notify_outbox; print(notify_outbox.__version__)')"; \
	$(PY) -m build --outdir "$$tmp/dist" . >"$$tmp/build.log" 2>&1 \
		|| { cat "$$tmp/build.log" >&2; exit 1; }; \
	ls "$$tmp/dist"; \
	$(VENV)/bin/twine check --strict "$$tmp"/dist/*; \
	$(PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/python" -m pip install -q "$$tmp"/dist/*.whl; \
	got=$$(cd "$$tmp" && "$$tmp/venv/bin/notify-outbox" --version); \
	if [ "$$got" != "$$want" ]; then \
		echo "dist-check: the installed wheel says '$$got', expected '$$want'" >&2; exit 1; \
	fi; \
	echo "dist-check: $$got from the wheel in a fresh virtualenv"

# The Kubernetes kit (deploy/kubernetes/): its PrometheusRule matches the Prometheus rules, and
# every manifest validates strictly (unknown fields rejected, a missing schema fails) against the
# Kubernetes schemas of the pinned kubernetes-validate (dev extra) and the vendored CRD schemas.
# Then each deliberately broken manifest of tests/unit/k8s_broken/ must be rejected. No cluster.
k8s-check: $(STAMP)
	$(PY) -m tools.k8s rules --check
	$(PY) -m tools.k8s validate deploy/kubernetes
	@set -uo pipefail; for f in tests/unit/k8s_broken/*.yaml; do \
		out=$$($(PY) -m tools.k8s validate "$$f" 2>&1) && { \
			echo "k8s-check: $$f was accepted, but it is broken on purpose" >&2; exit 1; }; \
		grep -q "^k8s-check: $$f" <<<"$$out" || { \
			echo "k8s-check: $$f: the validator failed without naming it:" >&2; \
			echo "$$out" >&2; exit 1; }; \
	done; echo "k8s-check: each of the $$(ls tests/unit/k8s_broken/*.yaml | wc -l) manifests of tests/unit/k8s_broken/ was rejected"

# Side-by-side latency/throughput bench (bench/README.md), ~15-20 min on a quiet machine;
# BENCH_ARGS=--quick for a short run. Results land in bench/results/.
bench: $(STAMP)
	$(PY) -m bench run $(BENCH_ARGS)

# A few seconds of every bench phase; fails only if the bench itself breaks.
bench-smoke: $(STAMP)
	$(PY) -m bench smoke $(BENCH_ARGS)

# End to end on this machine: local PostgreSQL + Kafka, migrate, relay, plain-SQL producer in
# another process, consumer; prints latency and checks per-key order.
# Options: make demo DEMO_ARGS="--events 1000 --rate 100" (or --keep to leave the stack up).
demo: $(STAMP)
	$(PY) scripts/demo.py $(DEMO_ARGS)

# The consumer side: an order service, the relay, and a billing consumer that applies each
# order exactly once with the inbox (examples/orders). Options: EXAMPLE_ARGS="--orders 50".
example: $(STAMP)
	$(PY) -m examples.orders $(EXAMPLE_ARGS)

# Local services for manual work: `eval "$$(make -s stack-up)"` exports the settings.
stack-up: $(STAMP)
	@$(PY) -m devstack up

stack-down: $(STAMP)
	$(PY) -m devstack down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache dist build site
