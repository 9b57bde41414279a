#!/usr/bin/env bash
# Build the fusestate Hadoop FileSystem shim (build/fusestate-hadoop-shim.jar) with the JDK on
# the machine, against the Hadoop client jars bundled with PySpark. No downloads.
# Idempotent: does nothing when the jar is newer than every source file.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-$here/../../.venv/bin/python}
out=$here/build
jar_path=$out/fusestate-hadoop-shim.jar

if [ -f "$jar_path" ] && [ -z "$(find "$here/src" -name '*.java' -newer "$jar_path" -print -quit)" ]; then
    echo "$jar_path"
    exit 0
fi
command -v javac >/dev/null || { echo "build.sh: javac not found (install a JDK, e.g. openjdk-17-jdk-headless)" >&2; exit 1; }
jars=$("$python" -c "import pyspark, os; print(os.path.join(os.path.dirname(pyspark.__file__), 'jars'))")
[ -d "$jars" ] || { echo "build.sh: no PySpark jars at $jars" >&2; exit 1; }

rm -rf "$out/classes"
mkdir -p "$out/classes"
find "$here/src/main/java" -name '*.java' > "$out/sources.txt"
javac -nowarn --release 17 -d "$out/classes" -cp "$jars/*" @"$out/sources.txt"
tmp=$(mktemp "$out/.jar.XXXXXX")
jar --create --file "$tmp" -C "$out/classes" .
mv -f "$tmp" "$jar_path"
echo "$jar_path"
