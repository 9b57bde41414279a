#!/usr/bin/env bash
# Set everything up and run the test suite (the default selection; add -m slow for heavier runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

# Every file of the run, its mountpoints among them, lives under one directory of its own:
# pytest's --basetemp (xdist's workers use subdirectories of it). A --basetemp given on the
# command line is used and kept; otherwise the run makes one, removed after a passing run.
basetemp=""
prev=""
for arg in "$@"; do
    case "$arg" in
        --basetemp=*) basetemp=${arg#--basetemp=} ;;
    esac
    if [ "$prev" = "--basetemp" ]; then basetemp=$arg; fi
    prev=$arg
done
own_basetemp=0
if [ -z "$basetemp" ]; then
    basetemp=$(mktemp -d "${TMPDIR:-/tmp}/fusestate-tests.XXXXXX")
    own_basetemp=1
    set -- --basetemp "$basetemp" "$@"
fi
basetemp=$(realpath -m "$basetemp")

# Lazily unmount whatever is still mounted under $1 (a test that failed before its teardown,
# or a run that was interrupted), deepest first: in this mount namespace and in any other one
# (a cluster test's nodes each have their own). Mounts anywhere else on the machine, such as a
# fusestate sidecar's or another run's, are never touched.
# shellcheck disable=SC2317  # (this and finish run from the EXIT trap)
detach_leftovers() {
    set +e
    local root=${1%/}/ seen=" " pid ns enter
    root=${root// /\\040}  # /proc/*/mounts writes a space in a path as \040
    for pid in self /proc/[0-9]*; do
        pid=${pid#/proc/}
        ns=$(readlink "/proc/$pid/ns/mnt" 2>/dev/null) || continue
        case "$seen" in *" $ns "*) continue ;; esac
        seen="$seen$ns "
        enter=()
        if [ "$pid" != self ]; then enter=(nsenter "--mount=/proc/$pid/ns/mnt" --); fi
        ROOT=$root awk 'index($2, ENVIRON["ROOT"]) == 1 {print length($2), $3, $2}' "/proc/$pid/mounts" 2>/dev/null |
            sort -rn |
            while read -r _ type path; do
                path=$(printf '%b' "$path")
                case "$type" in
                    fuse*) "${enter[@]}" fusermount3 -u -z "$path" 2>/dev/null || "${enter[@]}" umount -l "$path" || true ;;
                    *) "${enter[@]}" umount -l "$path" || true ;;
                esac
                echo "test.sh: detached $path ($type), left mounted by the tests" >&2
            done
    done
    return 0
}

status=1
# shellcheck disable=SC2317
finish() {
    detach_leftovers "$basetemp"
    if [ "$own_basetemp" = 1 ] && [ "$status" = 0 ]; then
        rm -rf --one-file-system "$basetemp" 2>/dev/null || true
    else
        echo "test.sh: the run's files (each test's cache dir holds its daemon's log) are in $basetemp" >&2
    fi
}
trap finish EXIT

set +e
# Two workers, one test file each at a time (a file's module fixtures, such as the Spark
# baseline run, are built once): most tests wait on mounts, daemons and JVMs, not the CPU.
# FUSESTATE_TEST_WORKERS=0 runs everything in this process.
.venv/bin/pytest -q -p no:cacheprovider --durations=12 -n "${FUSESTATE_TEST_WORKERS:-2}" --dist loadfile "$@"
status=$?
set -e
exit $status
