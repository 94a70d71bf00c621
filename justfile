# Developer loop. `just` is optional: every recipe is a plain command.

setup:
    ./scripts/setup.sh

test *ARGS:
    ./scripts/test.sh {{ARGS}}

run *ARGS:
    ./scripts/run.sh {{ARGS}}

bench:
    .venv/bin/coevo bench bus --json runs/bench/bus.json
    .venv/bin/coevo bench codec --json runs/bench/codec.json

lint:
    .venv/bin/ruff check coevo tests examples scripts
    .venv/bin/ruff format --check coevo tests examples scripts
    .venv/bin/mypy
    .venv/bin/lint-imports

fmt:
    .venv/bin/ruff format coevo tests examples scripts
    .venv/bin/ruff check --fix coevo tests examples scripts

check: lint test
