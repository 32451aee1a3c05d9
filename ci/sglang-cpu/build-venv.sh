#!/usr/bin/env bash
# Build (once) the SGLang CPU server venv of `make sglang-cpu` and print its path on stdout.
#
# The venv lives outside the checkout, at the path venv_path.py prints
# (${MEGARL_CACHE:-$HOME/.cache/megarl}/sglang-cpu-<sha256 of requirements.lock>), so a clean
# checkout with the same lock reuses it. It is built in a temporary directory and renamed into
# place only when the import check passed: an interrupted build never leaves a half venv under
# the final name. Every stage prints a line with its duration (on stderr; stdout is the path).
#
# Stages: venv, CPU torch (the lock's torch pin, with its dependencies), the rest of the lock
# with --no-deps (exact versions, nothing resolved), megarl's stand-ins from
# tests/sglang/sgl_kernel_stub (copied into site-packages: the kernel package stub and the
# torchvision import guard, the guards of SGLang's host-memory pinning and of its LoRA layers' pinned tensors; re-copied on every run, so an existing venv gets edits to them),
# and an import check of what `python -m sglang.launch_server` needs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
lock="$here/requirements.lock"
stub="$root/tests/sglang/sgl_kernel_stub"
python="${PYTHON:-python3}"
venv="$("$python" "$here/venv_path.py")"

log() { echo "sglang-cpu: $*" >&2; }
stage() {  # stage NAME COMMAND...: run it, then print how long it took
  local name="$1" start=$SECONDS
  shift
  log "$name ..."
  "$@"
  log "$name done in $((SECONDS - start)) s"
}

install_stub() {  # copy the stand-ins into the venv's site-packages (never into other packages)
  local site
  site="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -rf "$site/sgl_kernel"
  cp -r "$stub/sgl_kernel" "$site/sgl_kernel"
  cp "$stub/megarl_torchvision_guard.py" "$stub/megarl_torchvision_guard.pth" "$site/"
  cp "$stub/megarl_host_register_guard.py" "$stub/megarl_host_register_guard.pth" "$site/"
  cp "$stub/megarl_pin_memory_guard.py" "$stub/megarl_pin_memory_guard.pth" "$site/"
}

check_imports() {  # what the server imports first; a broken venv fails here, not in a test
  "$1/bin/python" -c "import sgl_kernel, torchvision.transforms, sglang.srt.server_args, sglang.launch_server; import sglang; print('sglang', sglang.__version__)" >&2
}

if [ -x "$venv/bin/python" ]; then
  log "reusing $venv"
  stage "stub" install_stub "$venv"
  echo "$venv"
  exit 0
fi

# A build killed too hard to run its trap (SIGKILL, a machine stop) leaves its temporary
# directory; remove those whose build process is gone (the pid is in the name).
for old in "$venv".tmp.*; do
  pid="${old#"$venv".tmp.}"
  pid="${pid%%.*}"
  if [ -d "$old" ] && ! kill -0 "$pid" 2>/dev/null; then
    log "removing $old (an interrupted build)"
    rm -rf "$old"
  fi
done

total=$SECONDS
mkdir -p "$(dirname "$venv")"
tmp="$(mktemp -d "$venv.tmp.$$.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
log "building $venv (about 3 GB; a few minutes)"
pip=("$tmp/bin/python" -m pip install --quiet --disable-pip-version-check)
stage "venv" "$python" -m venv "$tmp"
# torch first, pinned, with its dependencies: the local CPU build, never a CUDA one.
stage "torch" "${pip[@]}" "$(grep -E '^torch==' "$lock")"
grep -vE '^torch==' "$lock" > "$tmp/rest.txt"
stage "lock" "${pip[@]}" --no-deps -r "$tmp/rest.txt"
stage "stub" install_stub "$tmp"
stage "check" check_imports "$tmp"
# Console scripts carry the temporary path in their shebang; fix them to the final one (the
# tests only run "$venv/bin/python -m ...", but a user may run bin/ scripts).
grep -rlI --null "$tmp" "$tmp/bin" | xargs -0 -r sed -i "s|$tmp|$venv|g"
rm -f "$tmp/rest.txt"
if [ -e "$venv" ]; then  # another build finished first: keep that one
  log "$venv appeared meanwhile; keeping it"
else
  mv "$tmp" "$venv"
fi
trap - EXIT
rm -rf "$tmp"
log "ready: $venv ($(du -sh "$venv" | cut -f1), $((SECONDS - total)) s)"
echo "$venv"
