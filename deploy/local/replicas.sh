#!/usr/bin/env bash
# Several `snug serve` replicas behind an existing router, on this machine.
#
#   deploy/local/replicas.sh [MODEL]
#
# Starts REPLICAS replicas (default 3) on ports 8101.., each publishing
# its KV events on 5601.., sharing one prefix-cache folder (so a
# conversation moves between replicas with its KV pages), and a router on
# ROUTER_PORT (default 8100) that clients use as the OpenAI base URL:
#
#   ROUTER=vllm    vllm-router with its kv_aware policy, fed by the KV events
#                  (the default)
#   ROUTER=sglang  sglang-router with its cache_aware policy (an approximate
#                  prefix tree of the requests it routed)
#   ROUTER=vllm POLICY=round_robin   any other policy of either router
#
# The routers come from PyPI (pip install vllm-router sglang-router); set
# VENV to the folder holding their commands if they are not on PATH.
# Ctrl-C stops everything.
set -euo pipefail
model=${1:-smollm2-135m}
snug=${SNUG:-snug}
replicas=${REPLICAS:-3}
threads=${THREADS:-1}
router=${ROUTER:-vllm}
router_port=${ROUTER_PORT:-8100}
venv=${VENV:+$VENV/}
cache=${PREFIX_CACHE_DIR:-$(mktemp -d -t snug-prefix-XXXX)}

pids=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

workers=()
sources=()
for i in $(seq 1 "$replicas"); do
  port=$((8100 + i))
  events=$((5600 + i))
  "$snug" serve "$model" --port "$port" --threads "$threads" --kv-page 16 \
    --prefix-cache-dir "$cache" --kv-events "tcp://*:$events" ${SNUG_ARGS:-} &
  pids+=($!)
  workers+=("http://127.0.0.1:$port")
  sources+=(--kv-event-source "http://127.0.0.1:$port=tcp://127.0.0.1:$events")
done
for w in "${workers[@]}"; do
  until curl -sf "$w/health" >/dev/null; do sleep 0.5; done
done
case "$router" in
  vllm)
    policy=${POLICY:-kv_aware}
    extra=()
    if [ "$policy" = kv_aware ]; then
      extra=("${sources[@]}" --kv-event-block-size 16 --kv-event-model "$model")
    fi
    "${venv}vllm-router" --port "$router_port" --policy "$policy" \
      --worker-urls "${workers[@]}" "${extra[@]}" &
    ;;
  sglang)
    "${venv}python3" -m sglang_router.launch_router --port "$router_port" \
      --policy "${POLICY:-cache_aware}" --worker-urls "${workers[@]}" &
    ;;
  *)
    echo "ROUTER must be vllm or sglang" >&2
    exit 2
    ;;
esac
pids+=($!)
echo "replicas: ${workers[*]} (prefix cache in $cache)"
echo "router:   http://127.0.0.1:$router_port/v1"
wait
