"""The deployment files: systemd units and mount helpers, the Helm chart and the Spark pod
template, the Grafana dashboard, the Prometheus scrape configuration.

Tools that are not part of the test dependencies are used when present and the tests
that need them skip, saying which, when not:
- Debian packages: systemd (systemd-analyze), shellcheck, prometheus (promtool), fuse3
- PyPI: helm-python-sdk (Helm's own Go SDK, renders and lints the chart),
  kubernetes-validate (Kubernetes JSON schemas, bundled), promql-parser
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "systemd"
CHART = ROOT / "helm" / "fusestate"
SPARK_TEMPLATE = ROOT / "helm" / "examples" / "spark-executor-pod-template.yaml"
SPARK_CLUSTER_TEMPLATE = ROOT / "helm" / "examples" / "spark-cluster-pod-template.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "fusestate-dashboard.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
FUSESTATE_BIN = Path(sys.executable).parent / "fusestate"
INSTALLED_BIN = "/opt/fusestate/.venv/bin/fusestate"
METRICS_PORT = 9567

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the deployment files")


def _need_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package {package})")
    return path


def _is_mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == real for line in f)


def _need_fuse() -> None:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.skip("needs root, /dev/fuse and fusermount3 (Debian package fuse3)")


def _wait_gone(pid: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _unmount_on_exit(path: Path) -> Iterator[None]:
    try:
        yield
    finally:
        if _is_mounted(path):
            subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


# ======================================================================== systemd


def _unit_settings(path: Path) -> dict[tuple[str, str], list[str]]:
    """[Section] Key=Value lines of a unit file; a key may repeat."""
    settings: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault((section, key.strip()), []).append(value.strip())
    return settings


def _read_env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads the simple cases."""
    env = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def _expand_command(command: str, env: dict[str, str]) -> tuple[bool, list[str]]:
    """An Exec*= line as systemd runs it: ${VAR} is one word, a word $VAR splits at
    whitespace (zero or more words). Returns (failure ignored, argv)."""
    ignore = command.startswith("-")
    argv: list[str] = []
    for word in shlex.split(command.lstrip("-")):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            argv.extend(env.get(whole.group(1), "").split())
            continue
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return ignore, argv


def _unit_environment(settings: dict, instance: str, env_file_text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in settings.get(("Service", "Environment"), []):
        key, _, val = value.replace("%i", instance).partition("=")
        env[key] = val
    env.update(_read_env_file(env_file_text))  # EnvironmentFile= overrides Environment=
    return env


def test_service_unit_settings():
    s = _unit_settings(SYSTEMD / "fusestate@.service")
    one = {key: values[-1] for key, values in s.items()}
    assert one["Service", "Type"] == "notify"
    assert one["Service", "NotifyAccess"] == "main"
    assert one["Service", "EnvironmentFile"] == "/etc/fusestate/%i.env"
    assert one["Service", "KillMode"] == "mixed"
    assert one["Service", "Restart"] == "on-failure"
    assert int(one["Service", "TimeoutStopSec"]) >= 600
    assert "network-online.target" in one["Unit", "After"]
    assert "network-online.target" in one["Unit", "Wants"]
    _, start = _expand_command(one["Service", "ExecStart"], {})
    assert start[0] == INSTALLED_BIN and start[1] == "mount" and "--foreground" in start
    _, stop = _expand_command(one["Service", "ExecStop"], {"FUSESTATE_MOUNTPOINT": "/mnt/x"})
    assert stop == [INSTALLED_BIN, "umount", "/mnt/x"]
    # Nothing that would give the service a mount namespace of its own.
    for key in ("PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateDevices", "ReadOnlyPaths",
                "TemporaryFileSystem", "PrivateMounts", "MountFlags"):
        assert ("Service", key) not in s, key


def test_systemd_units_verify(tmp_path: Path):
    """systemd-analyze verify, with fusestate where the unit expects it: the installed one,
    or a stub on a tmpfs over /opt in a private mount namespace (nothing on the machine
    changes)."""
    analyze = _need_tool("systemd-analyze", "systemd")
    units = tmp_path / "units"
    units.mkdir()
    shutil.copy(SYSTEMD / "fusestate@.service", units)
    (units / "fusestate@state.service").symlink_to("fusestate@.service")
    shutil.copy(SYSTEMD / "mnt-state.mount", units)
    verify = [analyze, "verify", "--man=no", str(units / "fusestate@state.service"), str(units / "mnt-state.mount")]
    if os.access(INSTALLED_BIN, os.X_OK):
        argv = verify
    else:
        unshare = shutil.which("unshare")
        if os.geteuid() != 0 or unshare is None:
            pytest.skip(f"{INSTALLED_BIN} is missing and a private mount namespace for a stub needs root and unshare")
        stub_dir = os.path.dirname(INSTALLED_BIN)
        script = (f"mount -t tmpfs tmpfs /opt && mkdir -p {stub_dir} && printf '#!/bin/sh\\n' > {INSTALLED_BIN}"
                  f" && chmod 755 {INSTALLED_BIN} && exec {shlex.join(verify)}")
        argv = [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", script]
        probe = subprocess.run([unshare, "--mount", "--propagation", "private", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot make a private mount namespace: {probe.stderr.decode().strip()}")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    # verify exits 0 on warnings too (unknown keys, bad values): any output is a finding.
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr


class _NotifySocket:
    """The receiving end of sd_notify, as systemd offers it in $NOTIFY_SOCKET."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[str] = []

    def wait_for(self, state: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while state not in self.messages:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                self.messages.extend(self.sock.recv(4096).decode().split("\n"))
            except socket.timeout:
                return False
        return True

    def close(self) -> None:
        self.sock.close()


def test_service_commands_run_the_daemon(tmp_path: Path):
    """The unit's own command lines, expanded as systemd does with the example settings
    file: start (READY=1), data in, ExecStop (STOPPING=1, flush, exit 0), start again
    (the data is there), SIGTERM as KillMode=mixed sends it (flush, exit 0), ExecStopPost."""
    _need_fuse()
    settings = _unit_settings(SYSTEMD / "fusestate@.service")
    bucket, mountpoint, cache = tmp_path / "bucket", tmp_path / "mnt" / "state", tmp_path / "cache"
    bucket.mkdir()
    example = (SYSTEMD / "fusestate.env.example").read_text()
    overrides = {"FUSESTATE_URL": f"file://{bucket}", "FUSESTATE_MOUNTPOINT": str(mountpoint),
                 "FUSESTATE_CACHE_DIR": str(cache), "FUSESTATE_CACHE_SIZE": "1G",
                 "FUSESTATE_OPTIONS": "--allow-other --upload-delay 0"}
    example_keys = set(_read_env_file(example))
    assert set(overrides) <= example_keys
    env_text = "\n".join(f"{k}={overrides.get(k, v)}" for k, v in _read_env_file(example).items())
    unit_env = _unit_environment(settings, "state", env_text)
    env = dict(os.environ, **unit_env)

    def command(key: str) -> tuple[bool, list[str]]:
        ignore, argv = _expand_command(settings["Service", key][0], unit_env)
        return ignore, [str(FUSESTATE_BIN) if a == INSTALLED_BIN else a for a in argv]

    notify = _NotifySocket(tmp_path / "notify")
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        notify.messages.clear()
        ignore, pre = command("ExecStartPre")
        subprocess.run(pre, check=not ignore, env=env)
        _, argv = command("ExecStart")
        proc = subprocess.Popen(argv, env=dict(env, NOTIFY_SOCKET=str(notify.path)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(proc)
        if not notify.wait_for("READY=1", 60):
            proc.kill()
            raise AssertionError(f"no READY=1: {proc.communicate()[1].decode()[-2000:]}")
        assert _is_mounted(mountpoint)
        return proc

    try:
        with _unmount_on_exit(mountpoint):
            proc = start()
            data = os.urandom(3 << 20)
            with open(mountpoint / "state.bin", "wb") as f:
                f.write(data)
            ignore, stop = command("ExecStop")
            assert ignore  # a failed stop command must not fail the service (Restart=on-failure)
            subprocess.run(stop, check=True, env=env, timeout=120)
            assert notify.wait_for("STOPPING=1", 5)
            assert proc.wait(timeout=60) == 0
            assert not _is_mounted(mountpoint)

            proc = start()
            assert (mountpoint / "state.bin").read_bytes() == data
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
            assert notify.wait_for("STOPPING=1", 5)
            assert not _is_mounted(mountpoint)

            ignore, post = command("ExecStopPost")
            assert ignore
            done = subprocess.run(post, capture_output=True, text=True, env=env)
            assert not (done.stdout + done.stderr).strip()  # nothing to detach, and quiet about it
    finally:
        notify.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _stub_program(tmp_path: Path) -> tuple[Path, Path]:
    """A program that records its arguments, one JSON list per run."""
    log = tmp_path / "calls.jsonl"
    stub = tmp_path / "stub-fusestate"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    stub.chmod(0o755)
    return stub, log


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_mount_helper_translates_options(tmp_path: Path):
    stub, log = _stub_program(tmp_path)
    env = dict(os.environ, FUSESTATE_BIN=str(stub))
    helper = str(SYSTEMD / "mount.fusestate")
    opts = ("rw,_netdev,nofail,x-systemd.requires=network-online.target,comment=x,cache_dir=/var/cache/fs/a,"
            "cache_size=50G,max_dirty=1G,allow_other,ro,endpoint_url=http://127.0.0.1:9000/x?a=b,"
            "metrics_addr=0.0.0.0:9567,readahead=4,takeover,scratch=blockmgr-*,nosuid,nodev,"
            "meta=postgresql://fs@db.internal:5432/volumes,session_timeout=20,inline_max=0")
    subprocess.run([helper, "s3://bucket/vol", "/mnt/a b", "-n", "-o", opts, "-t", "fusestate"], check=True, env=env)
    assert _calls(log) == [[
        "mount", "s3://bucket/vol", "/mnt/a b", "--cache-dir", "/var/cache/fs/a", "--cache-size", "50G",
        "--max-dirty", "1G", "--allow-other", "--read-only", "--endpoint-url", "http://127.0.0.1:9000/x?a=b",
        "--metrics-addr", "0.0.0.0:9567", "--readahead", "4", "--takeover", "--scratch", "blockmgr-*",
        "-o", "nosuid", "-o", "nodev", "--meta", "postgresql://fs@db.internal:5432/volumes", "--session-timeout", "20",
        "--inline-max", "0"]]
    # Every option of the fstab example is understood.
    for line in (SYSTEMD / "fstab.example").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        url, mountpoint, fstype, options, dump, passno = line.split()
        assert fstype == "fusestate" and (dump, passno) == ("0", "0")
        log.unlink()
        subprocess.run([helper, url, mountpoint, "-o", options], check=True, env=env)
        (argv,) = _calls(log)
        assert argv[:3] == ["mount", url, mountpoint] and "-o" not in argv and "--cache-dir" in argv
    # -f (fake) runs nothing; a bad call says how to call.
    log.unlink()
    subprocess.run([helper, "s3://b/v", "/mnt/x", "-f", "-o", "cache_size=1G"], check=True, env=env)
    assert not log.exists()
    bad = subprocess.run([helper, "s3://b/v"], capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and "usage" in bad.stderr


def test_mount_helpers_mount_and_unmount(tmp_path: Path):
    """mount.fusestate starts a real daemon; umount.fuse.fusestate flushes and waits for it,
    and detaches a mount whose daemon is dead."""
    _need_fuse()
    bucket, mountpoint, cache = tmp_path / "bucket", tmp_path / "mnt", tmp_path / "cache"
    bucket.mkdir()
    mountpoint.mkdir()
    env = dict(os.environ, FUSESTATE_BIN=str(FUSESTATE_BIN))
    mount = [str(SYSTEMD / "mount.fusestate"), f"file://{bucket}", str(mountpoint),
             "-o", f"_netdev,cache_dir={cache},cache_size=1G,upload_delay=0"]
    umount = [str(SYSTEMD / "umount.fuse.fusestate"), str(mountpoint), "-n"]

    def status() -> dict:
        out = subprocess.run([str(FUSESTATE_BIN), "status", "--json", str(mountpoint)],
                             check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out)

    with _unmount_on_exit(mountpoint):
        subprocess.run(mount, check=True, env=env, timeout=120)
        pid = status()["pid"]
        (mountpoint / "f").write_bytes(b"x" * (5 << 20))
        subprocess.run(umount, check=True, env=env, timeout=120)
        assert not _is_mounted(mountpoint)
        assert _wait_gone(pid, 10)
        assert any((bucket / "blocks").rglob("*")), "umount returned before the data was in the bucket"

        subprocess.run(mount, check=True, env=env, timeout=120)
        pid = status()["pid"]
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone(pid, 10)
        done = subprocess.run(umount, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        assert not _is_mounted(mountpoint)


def test_shell_scripts_shellcheck(tmp_path: Path):
    """The mount helpers, and the shell commands of the chart's container and of the Spark
    pod template's init container."""
    shellcheck = _need_tool("shellcheck", "shellcheck")
    scripts = [SYSTEMD / "mount.fusestate", SYSTEMD / "umount.fuse.fusestate"]
    embedded = {"spark-init.sh": yaml.safe_load(SPARK_TEMPLATE.read_text())["spec"]["initContainers"][0]["command"][-1]}
    with contextlib.suppress(pytest.skip.Exception):
        container = _container(_render(_ci_values(VALUE_SETS["default"])))
        embedded["daemonset.sh"] = container["args"][0]
    for name, body in embedded.items():
        path = tmp_path / name
        path.write_text("#!/bin/sh\n" + body)
        scripts.append(path)
    proc = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ======================================================================== Helm chart

# Kubernetes versions to validate against: the chart's kubeVersion floor and the newest
# schemas kubernetes-validate bundles.
KUBE_FLOOR = "1.25.0"

# What the chart may put in a ServiceMonitor, typed as in the Prometheus Operator's CRD
# (monitoring.coreos.com/v1); kubernetes-validate has no schemas for custom resources.
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STRING_MAP,
            "annotations": _STRING_MAP}},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "jobLabel": {"type": "string"},
            "selector": {"type": "object", "additionalProperties": False, "properties": {
                "matchLabels": _STRING_MAP, "matchExpressions": {"type": "array"}}},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                    "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
                    "relabelings": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "sourceLabels": {"type": "array", "items": _LABEL_NAME},
                            "separator": {"type": "string"}, "targetLabel": {"type": "string"},
                            "regex": {"type": "string"}, "replacement": {"type": "string"},
                            "modulus": {"type": "integer"},
                            "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                                                "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                                                "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal",
                                                "KeepEqual", "dropequal", "DropEqual"]}}}}}}},
        }},
    },
}


def _helm():
    return pytest.importorskip("helm_python", reason="needs helm-python-sdk (pip), which renders and lints the chart with Helm's Go SDK")


def _ci_values(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / name).read_text()) or {}


def _render(values: dict, namespace: str = "storage") -> dict[str, list[dict]]:
    """The chart rendered as `helm template fusestate helm/fusestate` would: kind -> objects."""
    helm = _helm()
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="fusestate", namespace=namespace, is_install=True)
    objects: dict[str, list[dict]] = {}
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            assert text.strip()
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.setdefault(doc["kind"], []).append(doc)
    return objects


VALUE_SETS = {
    "default": "default-values.yaml",
    "servicemonitor": "servicemonitor-values.yaml",
    "shared": "shared-values.yaml",
}


@pytest.fixture(params=sorted(VALUE_SETS), scope="module")
def rendered(request) -> tuple[str, dict, dict[str, list[dict]]]:
    values = _ci_values(VALUE_SETS[request.param])
    return request.param, values, _render(values)


def test_chart_lints_clean():
    helm = _helm()
    for name in VALUE_SETS.values():
        report = helm.lint(str(CHART), _ci_values(name), strict=True, namespace="storage")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not report["errors"] and not problems, report


def test_chart_refuses_a_shared_engine_with_a_volume_per_node():
    helm = _helm()
    values = {"volume": {"url": "s3://b/v"}, "meta": {"url": "postgresql://fs@db:5432/volumes"}}
    with pytest.raises(Exception, match="set volume.perNode=false"):
        _render(values)
    values["volume"]["perNode"] = False
    env = _env(_container(_render(values)))
    assert env["FUSESTATE_META_URL"] == {"name": "FUSESTATE_META_URL", "value": "postgresql://fs@db:5432/volumes"}
    assert helm  # rendered with Helm's own engine


def test_chart_objects(rendered):
    name, _, objects = rendered
    expected = {"DaemonSet", "ServiceAccount"}
    if name == "servicemonitor":
        expected |= {"ServiceMonitor", "Service", "Secret"}
    assert set(objects) == expected
    assert all(len(v) == 1 for v in objects.values())


def test_chart_manifests_match_kubernetes_schemas(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (pip), which bundles the Kubernetes schemas")
    jsonschema = pytest.importorskip("jsonschema")
    _, _, objects = rendered
    for kind, docs in objects.items():
        for doc in docs:
            if kind == "ServiceMonitor":
                jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
                continue
            for version in (KUBE_FLOOR, kv.latest_version()):
                kv.validate(doc, version, strict=True)


LIVENESS_SCRIPT = 'fusestate status "$0" >/dev/null && stat -f "$0" >/dev/null'


def _container(objects: dict) -> dict:
    (ds,) = objects["DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_daemonset_contract(rendered):
    name, values, objects = rendered
    (ds,) = objects["DaemonSet"]
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    container = _container(objects)
    env = _env(container)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    mount_path = env["FUSESTATE_MOUNTPOINT"]["value"]
    host_mount_path = values.get("hostMountPath", "/mnt/fusestate")

    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"
    assert container["securityContext"]["privileged"] is True
    assert volumes["fuse-device"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert mounts["fuse-device"]["mountPath"] == "/dev/fuse"
    assert volumes["mounts"]["hostPath"]["path"] == host_mount_path
    assert mounts["mounts"] == {"name": "mounts", "mountPath": host_mount_path, "mountPropagation": "Bidirectional"}
    assert mount_path == f"{host_mount_path}/{values['volume'].get('name', 'state')}"

    # Metrics: every address, the annotated port, the named container port.
    assert env["FUSESTATE_METRICS_PORT"]["value"] == str(METRICS_PORT)
    assert '--metrics-addr "0.0.0.0:$FUSESTATE_METRICS_PORT"' in container["args"][0]
    assert {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"} in container["ports"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"

    # Stopping flushes: preStop umount, and time for it.
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["fusestate", "umount", mount_path]
    assert spec["terminationGracePeriodSeconds"] >= 600
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert mount_path in container[probe]["exec"]["command"]
        assert "fusestate status" in " ".join(container[probe]["exec"]["command"])
    assert "mountpoint -q" in " ".join(container["readinessProbe"]["exec"]["command"])
    # Liveness is `fusestate status`, its exit code unchanged (1 once a shared volume's session
    # was lost, test_shared.py), and a statfs of the mount (test_probes_fail_once_the_mount_is_dead):
    # the kubelet restarts the daemon, which mounts anew.
    liveness = container["livenessProbe"]
    assert liveness["exec"]["command"] == ["/bin/sh", "-c", LIVENESS_SCRIPT, mount_path]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] <= 300
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]

    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    if name == "shared":
        # One volume for every node, its metadata in the database named by the user's Secret.
        assert env["FUSESTATE_URL"]["value"] == values["volume"]["url"]
        assert env["FUSESTATE_META_URL"]["valueFrom"]["secretKeyRef"] == {"name": "fusestate-meta", "key": "url"}
        args = container["args"][1:]
        assert [args[i + 1] for i, a in enumerate(args) if a == "--scratch"] == ["blockmgr-*", "spark-*-*-*-*-*"]
        assert args[args.index("--session-timeout") + 1] == "20"
        assert args[args.index("--meta-outage-budget") + 1] == "60"
        assert args[args.index("--meta-connections") + 1] == "8"
        assert args[args.index("--inline-max") + 1] == "4096"
        return
    # A volume of its own per node: the URL ends in the node's name.
    assert env["FUSESTATE_URL"]["value"] == values["volume"]["url"].rstrip("/") + "/$(NODE_NAME)"
    assert "FUSESTATE_META_URL" not in env and "--session-timeout" not in container["args"]

    if name == "default":
        assert volumes["cache"]["hostPath"] == {"path": "/var/cache/fusestate", "type": "DirectoryOrCreate"}
        assert "envFrom" not in container and not any(k.startswith("AWS_") for k in env)
        assert "nodeSelector" not in spec and "tolerations" not in spec
    else:
        assert volumes["cache"] == {"name": "cache", "emptyDir": {"sizeLimit": values["cache"]["emptyDir"]["sizeLimit"]}}
        (secret,) = objects["Secret"]
        for key in values["credentials"]["env"]:
            assert env[key]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": key}
            assert secret["stringData"][key] == values["credentials"]["env"][key]
        gcs_key = values["credentials"]["gcsKeyFile"]["key"]
        assert env["GOOGLE_APPLICATION_CREDENTIALS"]["value"] == f"/var/run/secrets/fusestate/{gcs_key}"
        assert volumes["gcs-key"]["secret"]["items"] == [{"key": gcs_key, "path": gcs_key}]
        assert json.loads(secret["stringData"][gcs_key]) == json.loads(values["credentials"]["gcsKeyFile"]["content"])
        assert spec["nodeSelector"] == values["nodeSelector"]
        assert spec["tolerations"] == values["tolerations"]
        assert spec["priorityClassName"] == "system-node-critical"
        assert "checksum/credentials" in annotations
        # The ServiceMonitor finds the metrics Service, which finds the pods.
        (service,) = objects["Service"]
        (monitor,) = objects["ServiceMonitor"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["ports"] == [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        assert monitor["metadata"]["labels"]["release"] == values["serviceMonitor"]["labels"]["release"]


def test_daemonset_command_runs_fusestate_mount(rendered, tmp_path: Path):
    """Run the container's shell command with a recording stand-in for fusestate: the
    argv it builds, and the directories it makes."""
    _, values, objects = rendered
    container = _container(objects)
    stub, log = _stub_program(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "fusestate").symlink_to(stub)
    root = tmp_path / "root"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "NODE_NAME": "node-a"}
    for name, item in _env(container).items():
        if "value" in item:
            value = item["value"].replace("$(NODE_NAME)", "node-a")
            if name in ("FUSESTATE_MOUNTPOINT", "FUSESTATE_CACHE_DIR"):
                value = f"{root}{value}"
            env[name] = value
    subprocess.run([*container["command"], *container["args"]], check=True, env=env, timeout=30)
    assert Path(env["FUSESTATE_MOUNTPOINT"]).is_dir() and Path(env["FUSESTATE_CACHE_DIR"]).is_dir()
    (argv,) = _calls(log)
    volume = values["volume"]
    shared = "meta" in values
    url = volume["url"].rstrip("/") + ("" if shared else "/node-a")
    assert argv[:3] == ["mount", url, env["FUSESTATE_MOUNTPOINT"]]
    rest = argv[3:]

    def option(flag: str) -> Optional[str]:
        return rest[rest.index(flag) + 1] if flag in rest else None

    assert option("--cache-dir") == env["FUSESTATE_CACHE_DIR"]
    assert option("--cache-size") == str(values.get("cache", {}).get("size", "20G"))
    assert option("--metrics-addr") == f"0.0.0.0:{METRICS_PORT}"
    assert option("--durability") == volume.get("durability", "remote")
    assert option("--endpoint-url") == volume.get("endpointUrl")
    assert "--foreground" in rest and "--allow-other" in rest
    scratch = volume.get("scratch", ["blockmgr-*", "spark-*-*-*-*-*"])
    assert [rest[i + 1] for i, a in enumerate(rest) if a == "--scratch"] == scratch
    extra = [str(a) for a in volume.get("extraArgs", [])]
    assert rest[len(rest) - len(extra):] == extra


def test_chart_refuses_bad_values():
    helm = _helm()
    with pytest.raises(helm.HelmError, match="volume.url is required"):
        _render({})
    with pytest.raises(helm.HelmError, match="cache.type"):
        _render({"volume": {"url": "s3://b/v"}, "cache": {"type": "pvc"}})
    with pytest.raises(helm.HelmError, match="volume.name"):
        _render({"volume": {"url": "s3://b/v", "name": "../etc"}})
    objects = _render({"volume": {"url": "s3://b/v/", "perNode": False}, "credentials": {"existingSecret": "mine"}})
    container = _container(objects)
    assert _env(container)["FUSESTATE_URL"]["value"] == "s3://b/v"
    assert container["envFrom"] == [{"secretRef": {"name": "mine"}}]
    assert "Secret" not in objects


def _assert_replaced_with_the_mount(container: dict, bound: str) -> None:
    """A Spark container whose volume is bound to the mount as it was at its start ends
    within seconds when that mount is gone (the node's daemon died or restarted): its
    liveness probe asks the mount with statfs, which no kernel cache answers."""
    probe = container["livenessProbe"]
    assert probe["exec"]["command"] == ["stat", "-f", bound]
    assert probe["periodSeconds"] * probe["failureThreshold"] <= 10
    assert probe["failureThreshold"] >= 2 and probe["timeoutSeconds"] >= 5


def test_probes_fail_once_the_mount_is_dead(make_mount, file_bucket, tmp_path: Path):
    """The chart's liveness probe and the Spark templates', run for real on a mount: they pass
    while it answers and fail once its daemon was killed (the mount left in place answers
    ENOTCONN), the chart's even when its `fusestate status` answers (a stand-in here)."""
    _need_fuse()
    m = make_mount(file_bucket).mount()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "fusestate").symlink_to(_stub_program(tmp_path)[0])
    env = dict(os.environ, PATH=f"{bindir}:/usr/bin:/bin")
    daemon = ["/bin/sh", "-c", LIVENESS_SCRIPT, str(m.path)]
    templates = [yaml.safe_load(t.read_text())["spec"]["containers"][0]["livenessProbe"]["exec"]["command"]
                 for t in (SPARK_TEMPLATE, SPARK_CLUSTER_TEMPLATE)]
    spark = [[*command[:-1], str(m.path)] for command in templates]

    def passes(command: list[str]) -> bool:
        return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode == 0

    assert passes(daemon) and all(passes(c) for c in spark)
    m.kill(detach=False)
    try:
        assert not passes(daemon) and not any(passes(c) for c in spark)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)


def test_spark_pod_template():
    """The Spark pod template is a valid Pod, mounts the chart's host directory with
    HostToContainer, and gives Spark a local dir on the volume the chart mounts."""
    doc = yaml.safe_load(SPARK_TEMPLATE.read_text())
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    host = chart_values["hostMountPath"]
    volume_path = f"{host}/{chart_values['volume']['name']}"
    spec = doc["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["fusestate"]["hostPath"]["path"] == host
    # Spark sets SPARK_LOCAL_DIRS to the mount paths of volumes named spark-local-dir-*.
    assert volumes["spark-local-dir-1"]["hostPath"]["path"].startswith(volume_path + "/")
    (main,) = spec["containers"]
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["fusestate"] == {"name": "fusestate", "mountPath": host, "mountPropagation": "HostToContainer"}
    assert "spark-local-dir-1" in mounts
    (init,) = spec["initContainers"]
    script = init["command"][-1]
    assert volume_path in script and "fuse.fusestate" in script
    assert volumes["spark-local-dir-1"]["hostPath"]["path"] in script  # created once the volume is mounted
    _assert_replaced_with_the_mount(main, mounts["spark-local-dir-1"]["mountPath"])
    assert f"file://{volume_path}/checkpoints/" in SPARK_TEMPLATE.read_text()
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (pip), which bundles the Kubernetes schemas")
    for version in (KUBE_FLOOR, kv.latest_version()):
        kv.validate(doc, version, strict=True)


def test_spark_cluster_pod_template():
    """The shared volume's template gives Spark the volume itself as its local dir, so that
    the local dirs and the fusestate:// checkpoint are one mount (links do not cross mounts)."""
    doc = yaml.safe_load(SPARK_CLUSTER_TEMPLATE.read_text())
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    volume_path = f"{chart_values['hostMountPath']}/{chart_values['volume']['name']}"
    spec = doc["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["spark-local-dir-1"]["hostPath"]["path"] == volume_path
    (main,) = spec["containers"]
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    local = mounts["spark-local-dir-1"]
    assert local["mountPropagation"] == "HostToContainer" and "subPath" not in local
    _assert_replaced_with_the_mount(main, local["mountPath"])
    text = SPARK_CLUSTER_TEMPLATE.read_text()
    assert f"fusestate://{local['mountPath']}/checkpoints/" in text
    from fusestate.spark.shim import FS_CLASS, AFS_CLASS, JAR_NAME, MOUNT_WATCH_CLASS
    assert FS_CLASS in text and AFS_CLASS in text and JAR_NAME in text
    # An executor whose mount died ends itself at once (the shim's plugin), the probe is the backstop.
    assert f"--conf spark.plugins={MOUNT_WATCH_CLASS}" in text
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (pip), which bundles the Kubernetes schemas")
    for version in (KUBE_FLOOR, kv.latest_version()):
        kv.validate(doc, version, strict=True)


# ======================================================================== Grafana dashboard

METRICS = {
    # name: histogram?
    "fusestate_cache_hits_total": False, "fusestate_cache_misses_total": False,
    "fusestate_cache_hit_bytes_total": False, "fusestate_cache_miss_bytes_total": False,
    "fusestate_cache_entries": False, "fusestate_cache_bytes": False, "fusestate_cache_limit_bytes": False,
    "fusestate_cache_evictions_total": False, "fusestate_cache_corrupt_entries_total": False,
    "fusestate_block_read_seconds": True,
    "fusestate_dirty_bytes": False, "fusestate_dirty_limit_bytes": False,
    "fusestate_staged_blocks": False, "fusestate_staged_bytes": False, "fusestate_staged_oldest_age_seconds": False,
    "fusestate_upload_queue_length": False, "fusestate_uploaded_blocks_total": False,
    "fusestate_uploaded_bytes_total": False, "fusestate_upload_dedup_skipped_total": False,
    "fusestate_discarded_blocks_total": False, "fusestate_upload_failures_total": False,
    "fusestate_backpressure_waits_total": False, "fusestate_backpressure_wait_seconds_total": False,
    "fusestate_remote_requests_total": False, "fusestate_remote_retries_total": False,
    "fusestate_remote_received_bytes_total": False, "fusestate_remote_sent_bytes_total": False,
    "fusestate_remote_request_seconds": True,
    "fusestate_journal_entries_pending": False, "fusestate_journal_entries_shipped_total": False,
    "fusestate_journal_segments_shipped_total": False, "fusestate_journal_shipped_seq": False,
    "fusestate_journal_last_ship_age_seconds": False, "fusestate_journal_ship_failures_total": False,
    "fusestate_snapshots_shipped_total": False, "fusestate_lease_epoch": False, "fusestate_lease_held": False,
    "fusestate_fuse_operations_total": False, "fusestate_fuse_operation_seconds": True,
    "fusestate_fuse_read_bytes_total": False, "fusestate_fuse_written_bytes_total": False,
    "fusestate_files": False, "fusestate_used_bytes": False, "fusestate_cache_dir_free_bytes": False,
    "fusestate_gc_deleted_blocks_total": False,
}


def _known_metric(name: str) -> bool:
    if METRICS.get(name) is False:
        return True
    base, _, suffix = name.rpartition("_")
    return suffix in ("bucket", "sum", "count") and METRICS.get(base) is True


def _base_metric(name: str) -> str:
    return name if name in METRICS else name.rpartition("_")[0]


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _all_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in _all_panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if var["type"] == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def _as_promql(expr: str) -> str:
    """Grafana's variables replaced by values, so that Prometheus' grammar applies."""
    return expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$instance", ".*")


def _metric_names(expr: str) -> set[str]:
    """Metric names selected by an expression: from the syntax tree when promql-parser is
    there, else every name directly before a selector's braces or a fusestate_ name."""
    label_values = re.fullmatch(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*\w+\s*\)", expr)
    if label_values:
        return {label_values.group(1)}
    try:
        import promql_parser
    except ImportError:
        no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
        return set(re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{", no_strings)) | set(
            re.findall(r"\bfusestate_[a-z0-9_]+\b", no_strings))
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
            if node.matchers:
                names.update(m.value for m in node.matchers.matchers if m.name == "__name__")

    promql_parser.walk(promql_parser.parse(_as_promql(expr)), visit)
    names.discard(None)
    return names


def test_dashboard_uses_only_known_metrics():
    dashboard = _dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    used: set[str] = set()
    for expr in _expressions(dashboard):
        names = _metric_names(expr)
        assert names, expr
        unknown = {n for n in names if not _known_metric(n)}
        assert not unknown, f"{sorted(unknown)} in {expr}"
        used |= {_base_metric(n) for n in names}
    assert used == set(METRICS), f"metrics without a panel: {sorted(set(METRICS) - used)}"


def test_dashboard_structure():
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query" and variables["instance"]["multi"]
    datasource = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    assert variables["instance"]["datasource"] == datasource
    ids = [p["id"] for p in _all_panels(dashboard)]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in _all_panels(dashboard)}
    for wanted in ("Cache hit ratio per tier", "Cache bytes vs limit", "Block read latency (p50, p99) by source",
                   "Dirty vs limit, staged", "Upload throughput", "Uploads and upload queue",
                   "Dedup skips, discards, failures", "Backpressure", "Remote requests by op and outcome",
                   "Remote request latency (p50, p99) by op", "Journal lag", "Lease and shipped sequence",
                   "FUSE operations by op", "FUSE latency (p50, p99) by op", "Bytes read and written",
                   "Cache dir free space"):
        assert wanted in titles, wanted
    occupied: set[tuple[int, int]] = set()
    for panel in _all_panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & occupied, f"panel {panel['title']!r} overlaps another"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == datasource
        for target in panel["targets"]:
            assert target["datasource"] == datasource
            assert 'instance=~"$instance"' in target["expr"], target["expr"]
            if "rate(" in target["expr"]:
                assert "[$__rate_interval]" in target["expr"]


def test_dashboard_promql_parses(tmp_path: Path):
    """Every expression through Prometheus' own parser (promtool check rules), else through
    promql-parser."""
    exprs = [e for e in _expressions(_dashboard()) if not e.startswith("label_values(")]
    promtool = shutil.which("promtool")
    if promtool:
        rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:expr_{i}", "expr": _as_promql(e)} for i, e in enumerate(exprs)]}]}
        path = tmp_path / "rules.yml"
        path.write_text(yaml.safe_dump(rules))
        proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    promql_parser = pytest.importorskip("promql_parser", reason="needs promtool (Debian prometheus) or promql-parser (pip)")
    for expr in exprs:
        promql_parser.parse(_as_promql(expr))


# ======================================================================== Prometheus


def test_prometheus_scrape_config(tmp_path: Path):
    promtool = _need_tool("promtool", "prometheus")
    proc = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and "field kubernetes_sd_configs not found" in output:
        # Debian's Prometheus is built without Kubernetes discovery: check everything else,
        # the relabeling included, with the discovery replaced by a static target.
        config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
        for job in config["scrape_configs"]:
            if job.pop("kubernetes_sd_configs", None) is not None:
                job["static_configs"] = [{"targets": [f"127.0.0.1:{METRICS_PORT}"]}]
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        proc = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
        output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert all(t.endswith(f":{METRICS_PORT}") for t in jobs["fusestate"]["static_configs"][0]["targets"])
    relabel = jobs["fusestate-pods"]["relabel_configs"]
    address = next(r for r in relabel if r.get("target_label") == "__address__")
    regex = re.compile(address["regex"])
    match = regex.fullmatch(f"10.0.0.7:8080;{METRICS_PORT}")
    assert match and match.expand(address["replacement"].replace("$", "\\")) == f"10.0.0.7:{METRICS_PORT}"
