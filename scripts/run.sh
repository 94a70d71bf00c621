#!/usr/bin/env bash
# Set up (if needed) and run the closed loop with defaults (embedded NATS, quick game, tiny models).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/coevo run "$@"
