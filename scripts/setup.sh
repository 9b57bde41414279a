#!/usr/bin/env bash
# Install everything fusestate needs on a fresh Debian machine (run as root):
# FUSE 3, RocksDB's tools, and a virtualenv with fusestate and its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=0
for cmd in fusermount3 db_bench ldb pkg-config; do
    command -v "$cmd" >/dev/null 2>&1 || need_apt=1
done
[ -e /usr/include/fuse3/fuse_lowlevel.h ] || need_apt=1
if [ "$need_apt" = 1 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq fuse3 libfuse3-dev pkg-config rocksdb-tools >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
log=$(mktemp)
if ! { .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e '.[test]'; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup: pip install failed" >&2
    exit 1
fi
rm -f "$log"
echo "fusestate is installed in $(pwd)/.venv"
