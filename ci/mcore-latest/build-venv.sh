#!/usr/bin/env bash
# Build (once) the venv of `make test-mcore-latest` and print its path on stdout.
#
# The venv lives outside the checkout, in ${MEGARL_CACHE:-$HOME/.cache/megarl}/mcore-latest-<key>,
# where <key> is the sha256 of requirements.txt beside this script and of pyproject.toml (whose
# dependencies are installed too): a clean checkout with the same files reuses it. It is built in
# a temporary directory and renamed into place only when complete, so an interrupted build never
# leaves a half venv behind under the final name. megarl itself is NOT installed: the tests put
# the checkout on PYTHONPATH, so they always import the checkout's code.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
lock="$here/requirements.txt"
python="${PYTHON:-python3}"
key="$(cat "$lock" "$root/pyproject.toml" | sha256sum | cut -c1-16)"
cache="${MEGARL_CACHE:-$HOME/.cache/megarl}"
venv="$cache/mcore-latest-$key"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
  echo "$venv"
  exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.mcore-latest-$key.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
log() { echo "mcore-latest venv: $*" >&2; }
log "building $venv (a few minutes)"
"$python" -m venv "$tmp"
pip=("$tmp/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: later resolutions then keep this CPU build instead of pulling a CUDA one.
"${pip[@]}" "$(grep -E '^torch==' "$lock")"
# megatron-core alone ignores Requires-Python (its cp311 wheel works); with the flag on every
# package, pip would also take dependencies that truly need 3.12 (a numpy sdist that fails).
"${pip[@]}" --no-deps --ignore-requires-python "$(grep -E '^megatron-core==' "$lock")"
# The rest of the lock (triton, megatron-core's own dependencies), then megarl's dependencies
# (not megarl itself: the checkout comes from PYTHONPATH), read from pyproject.toml.
grep -vE '^(megatron-core|torch)==' "$lock" > "$tmp/rest.txt"
"$tmp/bin/python" - "$root/pyproject.toml" >> "$tmp/rest.txt" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))
PY
"${pip[@]}" -r "$tmp/rest.txt" -c "$lock"
"$tmp/bin/python" -c "import megatron.core, triton; print(megatron.core.__version__)" >&2
touch "$tmp/.complete"
# venv scripts carry their directory in shebangs; the tests only run "$venv/bin/python -m ...".
rm -rf "$venv"
mv "$tmp" "$venv"
trap - EXIT
log "ready in $SECONDS s: $venv ($(du -sh "$venv" | cut -f1))"
echo "$venv"
