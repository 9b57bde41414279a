#!/usr/bin/env bash
# Install everything fusestate needs on a fresh Debian machine (run as root):
# FUSE 3, RocksDB's tools, the tools the deployment and metrics tests use (Prometheus,
# ShellCheck, systemd-analyze, strace), what the benchmarks compare against (fio, rclone, s3fs-fuse),
# PostgreSQL with Patroni, etcd and PgBouncer for the shared engine's tests, and a virtualenv
# with fusestate and its test and benchmark dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian's prometheus package starts a server on :9090 and enables it at boot. The tests run
# their own Prometheus on a free port: stop and disable the packaged one, with or without
# systemd as the init system.
stop_packaged_prometheus() {
    if [ -d /run/systemd/system ]; then
        systemctl disable --now --quiet prometheus.service >/dev/null 2>&1 || true
    else
        if [ -x /etc/init.d/prometheus ]; then
            /etc/init.d/prometheus stop >/dev/null 2>&1 || true
        fi
        update-rc.d prometheus disable >/dev/null 2>&1 || true
        deb-systemd-helper disable prometheus.service >/dev/null 2>&1 || true
    fi
}

# The same for a packaged PostgreSQL cluster: the tests start servers of their own.
stop_packaged_service() {
    if [ -d /run/systemd/system ]; then
        systemctl disable --now --quiet "$1.service" >/dev/null 2>&1 || true
    else
        if [ -x "/etc/init.d/$1" ]; then
            "/etc/init.d/$1" stop >/dev/null 2>&1 || true
        fi
        update-rc.d "$1" disable >/dev/null 2>&1 || true
    fi
}

need_apt=0
for cmd in fusermount3 db_bench ldb pkg-config prometheus promtool shellcheck systemd-analyze fio rclone s3fs strace ip tc; do
    command -v "$cmd" >/dev/null 2>&1 || need_apt=1
done
[ -e /usr/include/fuse3/fuse_lowlevel.h ] || need_apt=1
# PostgreSQL's server, for the shared metadata engine's tests (they start their own server),
# and what makes it highly available (Patroni with etcd) or pools its connections (PgBouncer),
# for the failover and pooler tests (they start their own too).
compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null || need_apt=1
for cmd in patroni etcd pgbouncer; do
    command -v "$cmd" >/dev/null 2>&1 || need_apt=1
done
if [ "$need_apt" = 1 ]; then
    had_prometheus=0
    case "$(dpkg-query -W -f='${Status}' prometheus 2>/dev/null || true)" in
        *" installed") had_prometheus=1 ;;
    esac
    had_postgresql=0
    case "$(dpkg-query -W -f='${Status}' postgresql 2>/dev/null || true)" in
        *" installed") had_postgresql=1 ;;
    esac
    # Services whose packages this run brings: stopped and disabled below.
    brought=()
    for pkg_service in etcd-server:etcd patroni:patroni pgbouncer:pgbouncer; do
        case "$(dpkg-query -W -f='${Status}' "${pkg_service%%:*}" 2>/dev/null || true)" in
            *" installed") ;;
            *) brought+=("${pkg_service#*:}") ;;
        esac
    done
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends \
        fuse3 libfuse3-dev pkg-config rocksdb-tools prometheus shellcheck systemd \
        fio rclone s3fs strace postgresql iproute2 patroni etcd-server pgbouncer >/dev/null
    # Only a server this script brought: one installed on purpose is left as it is.
    [ "$had_prometheus" = 1 ] || stop_packaged_prometheus
    [ "$had_postgresql" = 1 ] || stop_packaged_service postgresql
    for service in "${brought[@]}"; do
        stop_packaged_service "$service"
    done
fi

# A JDK for PySpark and for building the Spark Hadoop shim (spark/shim).
if ! command -v javac >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends openjdk-17-jdk-headless >/dev/null
fi
# Maven, which fetches Hadoop's S3A connector (hadoop-aws and the AWS SDK bundle, into
# ~/.cache/fusestate-bench) for the Spark baseline with its checkpoint on S3 (bench/s3a.py).
if ! command -v mvn >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends maven >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# pip reinstalls the package on every call (for a moment the venv has no fusestate, under the
# feet of anything running from it): install only when pyproject.toml changed since the last
# install into this venv. Remove the stamp to force a reinstall.
stamp=.venv/.fusestate-installed
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    log=$(mktemp)
    if ! { .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e '.[test,bench]'; } >"$log" 2>&1; then
        cat "$log" >&2
        echo "setup: pip install failed" >&2
        exit 1
    fi
    rm -f "$log"
    echo "$wanted" >"$stamp"
fi

# The native front end's kernel connection (native/: Rust, fuser and pyo3, built by maturin
# with cargo): built when its sources changed since the last build into this venv.
native_stamp=.venv/.fusestate-kernel-installed
native_wanted=$(cat native/Cargo.toml native/Cargo.lock native/pyproject.toml native/src/*.rs | sha256sum | cut -d' ' -f1)
if [ "$(cat "$native_stamp" 2>/dev/null)" != "$native_wanted" ]; then
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    if ! command -v cargo >/dev/null 2>&1; then
        echo "setup: no cargo (Rust): the native front end is not built; mounts use pyfuse3" >&2
    else
        echo "setup: building the native front end (native/, cargo)"
        log=$(mktemp)
        if ! .venv/bin/pip install -q ./native >"$log" 2>&1; then
            cat "$log" >&2
            echo "setup: building the native front end failed" >&2
            exit 1
        fi
        rm -f "$log"
        echo "$native_wanted" >"$native_stamp"
    fi
fi
echo "fusestate is installed in $(pwd)/.venv"
