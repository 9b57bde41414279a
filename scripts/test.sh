#!/usr/bin/env bash
# Set everything up and run the test suite (the default selection; add -m slow for heavier runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
# Two workers, one test file each at a time (a file's module fixtures, such as the Spark
# baseline run, are built once): most tests wait on mounts, daemons and JVMs, not the CPU.
# FUSESTATE_TEST_WORKERS=0 runs everything in this process.
.venv/bin/pytest -q -p no:cacheprovider --durations=12 -n "${FUSESTATE_TEST_WORKERS:-2}" --dist loadfile "$@"
status=$?
set -e
# Leave no mounts behind, whatever happened.
awk '$3 ~ /^fuse\.fusestate/ {print $2}' /proc/mounts | while read -r m; do fusermount3 -u -z "$m" || true; done
exit $status
