#!/usr/bin/env bash
# megarl's Ray node bootstrap: one node of a multi-node run (a Slurm job step, or a host you
# start by hand). `megarl sbatch` embeds this file in the scripts it writes; run it directly on
# clusters without Slurm.
#
#   ray-node.sh head PORT                          the Ray head on this node (blocks)
#   ray-node.sh worker HEAD_IP:PORT                a Ray worker node joining the head (blocks)
#   ray-node.sh wait HEAD_IP:PORT NNODES GPUS_PER_NODE TIMEOUT_S [EXPECTED_HOST ...]
#                                                  until NNODES nodes (each with GPUS_PER_NODE
#                                                  GPUs, 0 = CPU) joined; exit 1 naming the
#                                                  missing hosts after TIMEOUT_S
#
#   ray-node.sh relay                              (a Slurm job step) turn a TERM for the job's
#                                                  steps into a TERM for the batch shell
#
# Stopping a run at a safe point is a TERM for the megarl driver alone: it finishes the step
# and saves a checkpoint while Ray keeps running. `scancel --signal=TERM JOB` signals a job's
# steps but not its batch shell, where the driver runs: the relay step passes it on.
#
# Environment: MEGARL_NODE_IP (this node's address) or MEGARL_NODE_IFACE (the interface whose
# address to use, e.g. ib0; default: the first of `hostname -I`), RAY_TMPDIR (this node's Ray
# files go to $RAY_TMPDIR/ray; default /tmp), MEGARL_RAY_START_ARGS (optional: more `ray start`
# options for this node, split on spaces, e.g. "--num-cpus=16 --object-store-memory=10000000000"),
# JOIN_TIMEOUT_S (how long a worker waits for the head; default 600), PYTHON (default python3).
# Every node passes --temp-dir: without it, Ray gives a worker node the head's temp dir path.
set -euo pipefail

PYTHON=${PYTHON:-python3}
role=${1:?usage: ray-node.sh head PORT | worker HEAD_IP:PORT | wait HEAD_IP:PORT NNODES GPUS TIMEOUT_S [HOST ...]}
shift

node_ip() {
  if [[ -n ${MEGARL_NODE_IP:-} ]]; then
    echo "$MEGARL_NODE_IP"
  elif [[ -n ${MEGARL_NODE_IFACE:-} ]]; then
    ip -4 -o addr show dev "$MEGARL_NODE_IFACE" | awk '{split($4, a, "/"); print a[1]; exit}'
  else
    hostname -I | awk '{print $1}'
  fi
}

# Until the head's port answers (JOIN_TIMEOUT_S, default 600 s): `ray start` gives up after ~20 s.
wait_for_port() {
  local host=${1%:*} port=${1##*:} waited=0
  until (echo >"/dev/tcp/$host/$port") 2>/dev/null; do
    if ((waited >= ${JOIN_TIMEOUT_S:-600})); then
      echo "ray-node: the Ray head at $1 did not answer within $waited s" >&2
      exit 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
}

wait_for_nodes() {
  local address=$1 nnodes=$2 gpus=$3 timeout_s=$4
  shift 4
  "$PYTHON" - "$address" "$nnodes" "$gpus" "$timeout_s" "$@" <<'PY'
import socket, sys, time

import ray

address, nnodes, gpus, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
expected = sys.argv[5:]
deadline = time.monotonic() + timeout_s
head_host, head_port = address.rsplit(":", 1)
short = lambda host: host.split(".")[0]  # Slurm's short names vs Ray's hostnames
while True:  # the head may still be starting (a cold venv on a shared filesystem): retry until the deadline
    try:
        if not ray.is_initialized():
            # ray.init retries an address that does not answer forever (and ignores TERM meanwhile)
            socket.create_connection((head_host.strip("[]"), int(head_port)), timeout=5).close()
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    except (OSError, RuntimeError) as exc:  # OSError: ConnectionError, a refused or timed-out connect
        if time.monotonic() > deadline:
            sys.exit(f"ray-node: no Ray head answers at {address} after {timeout_s:g} s ({exc}); see the head's ray-*.log")
        time.sleep(2)
        continue
    ready = [n for n in nodes if n.get("Resources", {}).get("GPU", 0.0) >= gpus]
    if len(ready) >= nnodes:
        print(f"ray-node: {len(ready)} node(s) joined ({', '.join(sorted(n['NodeManagerHostname'] for n in ready))})")
        sys.exit(0)
    if time.monotonic() > deadline:
        joined = {short(n["NodeManagerHostname"]) for n in ready}
        missing = [h for h in expected if short(h) not in joined]
        few = [f"{n['NodeManagerHostname']} ({n.get('Resources', {}).get('GPU', 0):g} GPUs)" for n in nodes if n not in ready]
        print(f"ray-node: only {len(ready)} of {nnodes} node(s) with {gpus:g} GPUs joined within {timeout_s:g} s; "
              f"missing: {', '.join(missing) or 'unknown'}" + (f"; too few GPUs: {', '.join(few)}" if few else "")
              + "; see each node's ray-*.log", file=sys.stderr)
        sys.exit(1)
    time.sleep(2)
PY
}

read -ra extra_args <<<"${MEGARL_RAY_START_ARGS:-}"

case $role in
  head)
    exec ray start --head --node-ip-address="$(node_ip)" --port="${1:?head needs PORT}" --include-dashboard=false \
      --temp-dir="${RAY_TMPDIR:-/tmp}/ray" --disable-usage-stats ${extra_args[@]+"${extra_args[@]}"} --block ;;
  worker)
    wait_for_port "${1:?worker needs HEAD_IP:PORT}"
    exec ray start --address="${1:?worker needs HEAD_IP:PORT}" --node-ip-address="$(node_ip)" \
      --temp-dir="${RAY_TMPDIR:-/tmp}/ray" --disable-usage-stats ${extra_args[@]+"${extra_args[@]}"} --block ;;
  wait)
    wait_for_nodes "$@" ;;
  relay)
    trap 'echo "ray-node: SIGTERM for the job: passing it to the batch shell"; scancel --batch --signal=TERM "$SLURM_JOB_ID"; exit 0' TERM
    trap 'exit 0' USR1
    while :; do
      sleep 3600 &
      wait "$!" || true
    done ;;
  *)
    echo "ray-node.sh: unknown role '$role' (head, worker, wait or relay)" >&2
    exit 2 ;;
esac
