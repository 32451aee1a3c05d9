#!/usr/bin/env bash
# Download the wheels of ci/gpu/requirements.txt (no dependencies: the list is complete) for a
# CUDA machine that cannot reach a package index, into .whl/ of the checkout (git-ignored) or $1.
# PYTHON_VERSION (default 3.12, the NGC images') picks the interpreter they are built for; the
# platform is x86-64 Linux. About 5 MB. Then, on that machine: bash ci/gpu/run.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="${1:-$root/.whl}"
version="${PYTHON_VERSION:-3.12}"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
grep -vE '^\s*(#|$)' "$here/requirements.txt" > "$dest/.requirements.txt"
"${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$version" --implementation cp "${platforms[@]}" -d "$dest" -r "$dest/.requirements.txt"
rm -f "$dest/.requirements.txt"
echo "ci/gpu: $(ls "$dest"/*.whl | wc -l) wheels for CPython $version in $dest" >&2
