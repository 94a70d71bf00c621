#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite against real servers started by the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# side by side: over half of a serial run's CPU time is idle (servers starting, events awaited, processes
# killed and restarted), so 3 workers on 2 cores; whole files go to one worker (their servers and models
# are module fixtures). Tests marked `alone` (they time themselves or pin cores) run afterwards, one at a
# time. COEVO_TEST_WORKERS=0 runs everything serially; COEVO_TEST_MARK selects by marker in both runs
# (COEVO_TEST_MARK="not slow" ./scripts/test.sh: the fast subset). Pass -m only with COEVO_TEST_WORKERS=0.
workers=${COEVO_TEST_WORKERS:-3}
mark=${COEVO_TEST_MARK:-}
both() { if [ -n "$mark" ]; then echo "($1) and ($mark)"; else echo "$1"; fi; }
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q ${mark:+-m "$mark"} "$@"
fi
rc=0
.venv/bin/python -m pytest -q -n "$workers" --dist loadfile -m "$(both "not alone")" "$@" || rc=$?
alone=0
.venv/bin/python -m pytest -q -m "$(both alone)" "$@" || alone=$?
[ "$alone" = 5 ] && alone=0  # 5: the selection held no `alone` test
[ "$rc" = 5 ] && rc=0
[ "$rc" != 0 ] && exit "$rc"
exit "$alone"
