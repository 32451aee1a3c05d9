#!/usr/bin/env bash
# Slurm and munge from Debian's packages, for tests/e2e/test_slurm.py (which starts its own
# single-node cluster and skips where these are missing). Nothing to do when they are installed.
set -euo pipefail
need=(slurmctld slurmd sbatch munged mungekey)
missing=()
for cmd in "${need[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || [[ -x /usr/sbin/$cmd ]] || missing+=("$cmd")
done
if ((${#missing[@]} == 0)); then
  echo "slurm: installed ($(/usr/sbin/slurmd -V 2>/dev/null || echo version unknown))"
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "slurm: ${missing[*]} missing and no root apt-get here: tests/e2e/test_slurm.py will be skipped"
  exit 0
fi
echo "slurm: installing slurm-wlm and munge (apt)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
echo "slurm: installed ($(/usr/sbin/slurmd -V 2>/dev/null || echo version unknown))"
