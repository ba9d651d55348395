#!/usr/bin/env bash
# tito under Dynamo on one machine, in one command (`make dynamo`): Dynamo's frontend (OpenAI routes, Dynamo's own
# /inference/v1/generate, KV-aware routing, RL discovery) and one tito whose Dynamo vLLM sidecar it starts itself
# (--dynamo-namespace), with file discovery on loopback: no etcd, NATS or Kubernetes. Ctrl-C (or SIGTERM) stops both;
# tito drains first and takes its sidecar out of discovery. Extra arguments go to `tito serve` (e.g. --enable-lora).
# See docs/guides/dynamo.md.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
MODEL=${MODEL:-models/tiny-qwen3}
NAME=${NAME:-tiny}                  # the model name clients send
HTTP_PORT=${HTTP_PORT:-8000}        # the frontend's OpenAI API
RL_PORT=${RL_PORT:-$((HTTP_PORT + 1))}  # the frontend's RL discovery (GET /v1/rl/workers): Prime-RL's default, API port + 1
TITO_PORT=${TITO_PORT:-8100}        # tito's own HTTP port: the admin plane (pause, weights, LoRA)
GRPC_PORT=${GRPC_PORT:-50051}       # tito's gRPC port, which the sidecar drives
SYSTEM_PORT=${SYSTEM_PORT:-8082}    # the sidecar's system port (below 32768)

[ -f "$MODEL/config.json" ] || { echo "dynamo_local: $MODEL is not a model directory (no config.json)" >&2; exit 2; }
"$VENV/bin/python" -c "import dynamo.frontend, dynamo.vllm, grpc" 2>/dev/null || {
  echo "dynamo_local: Dynamo is not installed in $VENV; make dynamo installs it (the dynamo and grpc extras, then" \
       "ai-dynamo==1.6.1 --no-deps)" >&2; exit 2; }

# File discovery unless told otherwise (DYN_DISCOVERY_BACKEND=etcd ETCD_ENDPOINTS=http://127.0.0.1:2379: a local etcd).
export DYN_DISCOVERY_BACKEND=${DYN_DISCOVERY_BACKEND:-file}
if [ "$DYN_DISCOVERY_BACKEND" = file ]; then
  export DYN_FILE_KV=${DYN_FILE_KV:-$(mktemp -d "${TMPDIR:-/tmp}/dynamo-kv.XXXXXX")}
fi
export DYN_NAMESPACE=dynamo DYN_REQUEST_PLANE=tcp DYN_EVENT_PLANE=zmq DYN_TCP_RPC_HOST=127.0.0.1 \
       DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1 \
       VLLM_HOST_IP=127.0.0.1

DYN_ENABLE_RL=true DYN_RL_PORT=$RL_PORT DYN_VLLM_ENABLE_INFERENCE_V1_GENERATE=true \
  "$VENV/bin/python" -m dynamo.frontend --http-host 127.0.0.1 --http-port "$HTTP_PORT" --router-mode kv \
  --migration-limit 3 &
frontend=$!
announce() {  # once the frontend serves the model through tito: say how to reach it
  for _ in $(seq 1 600); do
    if curl -sf "localhost:$HTTP_PORT/v1/models" 2>/dev/null | grep -q "\"$NAME\""; then
      echo "dynamo_local: ready. OpenAI API http://127.0.0.1:$HTTP_PORT (model \"$NAME\"), RL discovery" \
           "http://127.0.0.1:$RL_PORT/v1/rl/workers, tito's admin plane http://127.0.0.1:$TITO_PORT" >&2
      return
    fi
    sleep 0.5
  done
  echo "dynamo_local: the frontend did not list \"$NAME\" within 300 s" >&2
}
announce &
announcer=$!
stop_frontend() {
  kill "$announcer" 2>/dev/null || true
  kill -TERM "$frontend" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$frontend" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$frontend" 2>/dev/null || true
}
trap stop_frontend EXIT

"$VENV/bin/python" -m tito serve --model "$MODEL" --served-model-name "$NAME" --port "$TITO_PORT" \
  --grpc-port "$GRPC_PORT" --block-size 32 --kv-events-port 0 \
  --dynamo-namespace dynamo --dynamo-system-port "$SYSTEM_PORT" "$@" &
tito=$!
# SIGTERM to this script: tito's own drain (it takes its sidecar out of discovery), then the frontend. Ctrl-C reaches
# every process of the terminal's group already: this script only waits for tito.
trap 'kill -TERM "$tito" 2>/dev/null || true' TERM
trap ':' INT
set +e
wait "$tito"; rc=$?
while kill -0 "$tito" 2>/dev/null; do wait "$tito"; rc=$?; done
exit "$rc"
