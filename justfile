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
    .venv/bin/ruff check coevo tests examples
    .venv/bin/mypy
    .venv/bin/lint-imports

check: lint test
