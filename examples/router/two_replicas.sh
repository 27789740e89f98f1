#!/usr/bin/env bash
# Two `kvflow serve` replicas behind vllm-router's cache-aware policy, all on this machine (loopback only):
# requests that share a prefix (a system prompt) go to the replica whose prefix cache holds it.
#
#   examples/router/two_replicas.sh                    # the embedded SmolLM2; the router on :8000
#   MODEL=path/to/model.gguf ROUTER_PORT=9000 examples/router/two_replicas.sh
#   curl localhost:8000/v1/chat/completions -d '{"messages": [...]}' -H 'Content-Type: application/json'
#
# Each replica's /metrics (vllm:prefix_cache_hits) and request log (LOG_DIR/replica-N.jsonl) show where a request
# landed. Environment: MODEL (default: the embedded model), ROUTER_PORT (8000), REPLICA_PORTS ("8001 8002"),
# LOG_DIR (.), SERVE_ARGS (more `kvflow serve` flags for every replica), BIN (where kvflow and vllm-router are:
# the venv's bin). vllm-router: `pip install vllm-router` (a Rust binary in the wheel).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
ROUTER_PORT=${ROUTER_PORT:-8000}
REPLICA_PORTS=${REPLICA_PORTS:-"8001 8002"}
LOG_DIR=${LOG_DIR:-.}
MODEL_ARGS=()
[ -n "${MODEL:-}" ] && MODEL_ARGS=(--model "$MODEL")
# shellcheck disable=SC2206
EXTRA=(${SERVE_ARGS:-})

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

urls=()
n=0
for port in $REPLICA_PORTS; do
    n=$((n + 1))
    "$BIN/kvflow" serve "${MODEL_ARGS[@]}" --host 127.0.0.1 --port "$port" \
        --request-log "$LOG_DIR/replica-$n.jsonl" "${EXTRA[@]}" &
    pids+=($!)
    urls+=("http://127.0.0.1:$port")
done
for url in "${urls[@]}"; do         # /health: 200 once the replica can serve
    until curl -sf "$url/health" >/dev/null 2>&1 || python3 -c "import urllib.request,sys; urllib.request.urlopen('$url/health', timeout=1)" 2>/dev/null; do
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "a replica exited" >&2; exit 1; }; done
        sleep 0.5
    done
done
echo "replicas ready: ${urls[*]}" >&2
"$BIN/vllm-router" --host 127.0.0.1 --port "$ROUTER_PORT" --worker-urls "${urls[@]}" --policy cache_aware \
    --health-check-endpoint /health --worker-startup-check-interval 1 \
    --prometheus-host 127.0.0.1 --prometheus-port "${ROUTER_METRICS_PORT:-29000}" --log-level warning &
pids+=($!)
wait -n "${pids[@]}"                 # any of them exiting ends the others (the trap)
