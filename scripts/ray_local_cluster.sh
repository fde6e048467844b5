#!/usr/bin/env bash
# Run COMMAND next to a two-node Ray cluster on this machine that talks over loopback only:
#   scripts/ray_local_cluster.sh [--cpus-per-node N] COMMAND...
# As root it enters new network, PID and mount namespaces (unshare) with only `lo` up, so Ray cannot use any other
# address, and every Ray process ends with the command. In COMMAND, RAY_ADDRESS names the head,
# RAY_LOCAL_CLUSTER_TMP the Ray temp dir, and RAY_AUTH_MODE=token with RAY_AUTH_TOKEN_PATH the cluster's own token
# (~/.ray/auth_token is not used). Example:
#   scripts/ray_local_cluster.sh .venv/bin/python scripts/benchmark.py vec-env --kinds batched ray
# Exit status: COMMAND's, or 3 when no namespace can be made.
set -euo pipefail
CPUS=1
if [ "${1:-}" = "--cpus-per-node" ]; then CPUS=$2; shift 2; fi
[ $# -ge 1 ] || { echo "usage: $0 [--cpus-per-node N] COMMAND..." >&2; exit 2; }
if [ -z "${RAY_LOCAL_CLUSTER_INSIDE:-}" ]; then
  if ! unshare --net --pid --fork --mount-proc true 2>/dev/null; then
    echo "ray_local_cluster.sh: cannot make a network namespace here (needs root and unshare)" >&2
    exit 3
  fi
  # --kill-child: if this process is killed, the namespace's first process dies, and the kernel ends all the others
  exec env RAY_LOCAL_CLUSTER_INSIDE=1 unshare --net --pid --fork --kill-child --mount-proc -- "$0" --cpus-per-node "$CPUS" "$@"
fi
ip link set lo up
# the `ray` next to the Python of the command: PYTHON, else COMMAND's first word if it is a python, else python3
case "$(basename "$1")" in python*) PY=${PYTHON:-$1} ;; *) PY=${PYTHON:-python3} ;; esac
RAY=${RAY:-$("$PY" -c 'import os, sys; print(os.path.join(os.path.dirname(sys.executable), "ray"))')}
TMP=$(mktemp -d /tmp/ray_local.XXXXXX)
PORT=6379
COMMON=(--node-ip-address=127.0.0.1 --num-cpus="$CPUS" --object-store-memory=100000000 --disable-usage-stats)
cleanup() { "$RAY" stop --force >/dev/null 2>&1 || true; rm -rf "$TMP"; }
trap cleanup EXIT
# Token authentication with a token of this cluster's own, set for every Ray process here: left unset, `ray start --head`
# turns it on when it finds ~/.ray/auth_token (a local ray.init() writes one) but the second node does not.
unset RAY_AUTH_TOKEN
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TMP/auth_token
(umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH")
"$RAY" start --head --port=$PORT --include-dashboard=false --temp-dir="$TMP" "${COMMON[@]}" >"$TMP/head.log" 2>&1 \
  || { cat "$TMP/head.log" >&2; exit 1; }
"$RAY" start --address=127.0.0.1:$PORT "${COMMON[@]}" >"$TMP/node2.log" 2>&1 || { cat "$TMP/node2.log" >&2; exit 1; }
export RAY_ADDRESS=127.0.0.1:$PORT RAY_LOCAL_CLUSTER_TMP=$TMP
set +e
"$@"
status=$?
exit $status
