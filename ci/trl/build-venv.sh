#!/usr/bin/env bash
# Build (once) the TRL venv of `make trl-venv` and print its path on stdout (progress on stderr).
# It lives outside the checkout at the path venv_path.py prints, is built in a temporary
# directory and renamed into place only after the import check passed, so an interrupted build
# never leaves a half venv under the final name.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
lock="$here/requirements.lock"
python="${PYTHON:-python3}"
venv="$("$python" "$here/venv_path.py")"
log() { echo "trl-venv: $*" >&2; }

if [ -x "$venv/bin/python" ]; then
  log "reusing $venv"
  echo "$venv"
  exit 0
fi
mkdir -p "$(dirname "$venv")"
tmp="$(mktemp -d "$venv.tmp.$$.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
log "building $venv (a few minutes the first time)"
"$python" -m venv "$tmp"
pip=("$tmp/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "$(grep -E '^torch==' "$lock")"  # the CPU torch first, never a CUDA one
grep -vE '^(#|torch==)' "$lock" > "$tmp/rest.txt"
"${pip[@]}" -r "$tmp/rest.txt"
"$tmp/bin/python" -c "import trl, torch; print('trl', trl.__version__, 'torch', torch.__version__)" >&2
grep -rlI --null "$tmp" "$tmp/bin" | xargs -0 -r sed -i "s|$tmp|$venv|g"
rm -f "$tmp/rest.txt"
if [ -e "$venv" ]; then
  log "$venv appeared meanwhile; keeping it"
else
  mv "$tmp" "$venv"
fi
trap - EXIT
rm -rf "$tmp"
log "ready: $venv"
echo "$venv"
