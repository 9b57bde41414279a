#!/usr/bin/env bash
# Build the fusestate Hadoop FileSystem shim with the JDK on the machine, against the Hadoop
# client jars bundled with PySpark (no downloads), into the Python package:
#   fusestate/spark/jars/fusestate-hadoop-shim.jar
# The jar is package data: it is committed, installed with fusestate (a wheel carries it), and
# needs no JDK at run time. Its manifest records a digest of the sources it was built from
# (Fusestate-Source-Digest); a test fails when the sources change and the jar was not rebuilt.
# Idempotent: does nothing when the jar's digest matches the sources.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-$here/../../.venv/bin/python}
out=$(cd "$here/../.." && pwd)/fusestate/spark/jars
jar_path=$out/fusestate-hadoop-shim.jar
classes=$(mktemp -d)
trap 'rm -rf "$classes"' EXIT

digest=$("$python" -c "import sys; sys.path.insert(0, '$here/../..'); from fusestate.spark.shim import source_digest; print(source_digest('$here'))")
if [ -f "$jar_path" ] && [ "$("$python" -c "from fusestate.spark.shim import jar_digest; print(jar_digest('$jar_path'))" 2>/dev/null)" = "$digest" ]; then
    echo "$jar_path"
    exit 0
fi
command -v javac >/dev/null || { echo "build.sh: javac not found (install a JDK, e.g. openjdk-17-jdk-headless)" >&2; exit 1; }
jars=$("$python" -c "import pyspark, os; print(os.path.join(os.path.dirname(pyspark.__file__), 'jars'))")
[ -d "$jars" ] || { echo "build.sh: no PySpark jars at $jars" >&2; exit 1; }

find "$here/src/main/java" -name '*.java' | sort > "$classes/sources.txt"
javac -nowarn --release 17 -d "$classes" -cp "$jars/*" @"$classes/sources.txt"
rm "$classes/sources.txt"
printf 'Fusestate-Source-Digest: %s\n' "$digest" > "$classes.manifest"
mkdir -p "$out"
tmp=$(mktemp "$out/.jar.XXXXXX")
jar --create --file "$tmp" --manifest "$classes.manifest" --date 2000-01-01T00:00:00Z -C "$classes" .
rm -f "$classes.manifest"
mv -f "$tmp" "$jar_path"
echo "$jar_path"
