#!/usr/bin/env bash
# Set everything up and run the test suite (the default selection; add -m slow for heavier runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/pytest -q -p no:cacheprovider "$@"
status=$?
set -e
# Leave no mounts behind, whatever happened.
awk '$3 ~ /^fuse\.fusestate/ {print $2}' /proc/mounts | while read -r m; do fusermount3 -u -z "$m" || true; done
exit $status
