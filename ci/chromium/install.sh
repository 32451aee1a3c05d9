#!/usr/bin/env bash
# Chromium from Debian's packages, for tests/unit/test_docs_site.py (which opens the built
# documentation site in headless Chromium and skips where it is missing). Nothing to do when it is installed.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  echo "chromium: installed ($(chromium --version 2>/dev/null || echo version unknown))"
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium: missing and no root apt-get here: tests/unit/test_docs_site.py will be skipped"
  exit 0
fi
echo "chromium: installing chromium (apt)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "chromium: installed ($(chromium --version 2>/dev/null || echo version unknown))"
