#!/usr/bin/env bash
# chatstore replicas behind nginx on a 3-master Redis Cluster for KV and one Redis for the
# session records, all on loopback.
#
#   deploy/cluster.sh up     [--replicas N] [--dir DIR]   start; writes DIR/cluster.env
#   deploy/cluster.sh status [--dir DIR]                  what runs, ready or not
#   deploy/cluster.sh down   [--dir DIR]                  stop everything started by up
#
# The same topology as tests/support/replicas.py and docker/compose.yaml; nginx's config is
# rendered from deploy/nginx.conf.template. Replicas run in local mode (no keys), so they
# only bind and answer on loopback. Environment: CHATSTORE_BIN (default .venv/bin/chatstore),
# PROXY_PORT (8080), REPLICA_BASE_PORT (8001), REDIS_BASE_PORT (7001; the records' Redis on
# the port after the masters), KV_MAXMEMORY (1gb per KV master), any CHATSTORE_* for the
# replicas (CHATSTORE_REDIS_URL, CHATSTORE_RECORDS_URL and CHATSTORE_REPLICA_ID are set here).
#
# KV and records have separate Redis with their own settings (docs/replicas.md, "The shared
# tier"): the KV cluster evicts by itself (deploy/redis-kv.conf: allkeys-lru at its
# maxmemory, no persistence); the records' Redis never evicts and is durable
# (deploy/redis-records.conf: noeviction, append-only).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CMD="${1:-}"
[[ -n "$CMD" ]] && shift
REPLICAS=2
DIR="${CHATSTORE_CLUSTER_DIR:-${CHATSTORE_HOME:-$HOME/.cache/chatstore}/cluster}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --replicas) REPLICAS="$2"; shift 2 ;;
        --dir) DIR="$2"; shift 2 ;;
        *) echo "cluster.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
CHATSTORE_BIN="${CHATSTORE_BIN:-$ROOT/.venv/bin/chatstore}"
PROXY_PORT="${PROXY_PORT:-8080}"
REPLICA_BASE_PORT="${REPLICA_BASE_PORT:-8001}"
REDIS_BASE_PORT="${REDIS_BASE_PORT:-7001}"
KV_MAXMEMORY="${KV_MAXMEMORY:-1gb}"
MASTERS=3
RECORDS_PORT=$((REDIS_BASE_PORT + MASTERS))
NGINX="$(command -v nginx || echo /usr/sbin/nginx)"

die() { echo "cluster.sh: $*" >&2; exit 1; }

# wait_for DESCRIPTION SECONDS COMMAND...: poll COMMAND every 0.2 s, bounded.
wait_for() {
    local what="$1" seconds="$2"; shift 2
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "$what not ready within ${seconds}s (logs in $DIR)"
        sleep 0.2
    done
}

cluster_ok() { redis-cli -p "$1" cluster info | grep -q 'cluster_state:ok'; }
http_ok() { curl -sf -o /dev/null "http://127.0.0.1:$1/readyz"; }

start_redis() {
    local nodes=()
    for ((i = 0; i < MASTERS; i++)); do
        local port=$((REDIS_BASE_PORT + i)) dir="$DIR/redis-$((REDIS_BASE_PORT + i))"
        mkdir -p "$dir"
        # KV only (deploy/redis-kv.conf): Redis owns eviction, nothing to persist.
        redis-server "$ROOT/deploy/redis-kv.conf" --port "$port" --bind 127.0.0.1 \
            --dir "$dir" --maxmemory "$KV_MAXMEMORY" \
            --cluster-enabled yes --cluster-config-file nodes.conf \
            --daemonize no >"$dir/redis.log" 2>&1 &
        echo $! >"$dir/pid"
        nodes+=("127.0.0.1:$port")
    done
    for ((i = 0; i < MASTERS; i++)); do
        wait_for "redis $((REDIS_BASE_PORT + i))" 15 redis-cli -p $((REDIS_BASE_PORT + i)) ping
    done
    # A restart finds its nodes.conf and rejoins; only a fresh cluster needs creating.
    if ! cluster_ok "$REDIS_BASE_PORT"; then
        redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes \
            >"$DIR/cluster-create.log" 2>&1 || die "redis-cli --cluster create failed"
    fi
    for ((i = 0; i < MASTERS; i++)); do
        wait_for "cluster state on $((REDIS_BASE_PORT + i))" 20 cluster_ok $((REDIS_BASE_PORT + i))
    done
    REDIS_URL="redis+cluster://$(IFS=,; echo "${nodes[*]}")"
    # The records (and leases, shred list): never evicted, append-only (redis-records.conf).
    local dir="$DIR/redis-$RECORDS_PORT"
    mkdir -p "$dir"
    redis-server "$ROOT/deploy/redis-records.conf" --port "$RECORDS_PORT" --bind 127.0.0.1 \
        --dir "$dir" --daemonize no >"$dir/redis.log" 2>&1 &
    echo $! >"$dir/pid"
    wait_for "redis $RECORDS_PORT" 15 redis-cli -p "$RECORDS_PORT" ping
    RECORDS_URL="redis://127.0.0.1:$RECORDS_PORT/0"
}

shared_secret() {
    # Encryption at rest: every replica seals and opens with one secret (docs/security.md).
    # CHATSTORE_SECRET_KEY from the caller wins; else one key file made once for the cluster.
    [[ -n "${CHATSTORE_SECRET_KEY:-}" ]] && return
    local file="$DIR/secret.key"
    if [[ ! -s "$file" ]]; then
        (umask 077 && echo "k1:$(head -c 32 /dev/urandom | base64 -w0)" >"$file")
    fi
    export CHATSTORE_SECRET_KEY_FILE="$file"
}

start_replicas() {
    shared_secret
    for ((i = 0; i < REPLICAS; i++)); do
        local port=$((REPLICA_BASE_PORT + i)) dir="$DIR/replica-$i"
        mkdir -p "$dir/data"
        CHATSTORE_REDIS_URL="$REDIS_URL" CHATSTORE_RECORDS_URL="$RECORDS_URL" \
            CHATSTORE_REPLICA_ID="r$i" \
            CHATSTORE_DATA_DIR="$dir/data" CHATSTORE_API_KEYS="" CHATSTORE_ADMIN_KEY="" \
            "$CHATSTORE_BIN" serve --host 127.0.0.1 --port "$port" >"$dir/server.log" 2>&1 &
        echo $! >"$dir/pid"
        # One at a time: the first start converts the model into CHATSTORE_HOME.
        wait_for "replica r$i" 180 http_ok "$port"
    done
}

start_nginx() {
    local dir="$DIR/nginx" servers=""
    mkdir -p "$dir"
    for ((i = 0; i < REPLICAS; i++)); do
        servers+="server 127.0.0.1:$((REPLICA_BASE_PORT + i)) max_fails=1 fail_timeout=5s; "
    done
    sed -e "s|@LISTEN@|127.0.0.1:$PROXY_PORT|" \
        -e "s|@BALANCE@|hash \$chatstore_session consistent;|" \
        -e "s|@UPSTREAM_SERVERS@|$servers|" \
        "$ROOT/deploy/nginx.conf.template" >"$dir/nginx.conf"
    "$NGINX" -e stderr -p "$dir" -c "$dir/nginx.conf" -g "daemon off; pid $dir/nginx.pid;" \
        >"$dir/nginx.log" 2>&1 &
    echo $! >"$dir/pid"
    wait_for "nginx" 10 http_ok "$PROXY_PORT"
}

write_env() {
    local pids=() urls=()
    for f in "$DIR"/redis-*/pid "$DIR"/replica-*/pid "$DIR"/nginx/pid; do pids+=("$(cat "$f")"); done
    for ((i = 0; i < REPLICAS; i++)); do urls+=("http://127.0.0.1:$((REPLICA_BASE_PORT + i))"); done
    cat >"$DIR/cluster.env" <<ENV
CHATSTORE_PROXY_URL=http://127.0.0.1:$PROXY_PORT
CHATSTORE_REPLICA_URLS=$(IFS=,; echo "${urls[*]}")
CHATSTORE_REDIS_URL=$REDIS_URL
CHATSTORE_RECORDS_URL=$RECORDS_URL
CHATSTORE_CLUSTER_PIDS="${pids[*]}"
ENV
}

stop_pidfile() {
    local file="$1" pid
    [[ -f "$file" ]] || return 0
    pid="$(cat "$file")"
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

down() {
    [[ -d "$DIR" ]] || { echo "nothing to stop in $DIR"; return 0; }
    # Front to back: no new requests, then drain the replicas, then Redis.
    stop_pidfile "$DIR/nginx/pid"
    for f in "$DIR"/replica-*/pid; do stop_pidfile "$f"; done
    for f in "$DIR"/redis-*/pid; do stop_pidfile "$f"; done
    rm -f "$DIR/cluster.env"
    echo "stopped (data kept in $DIR)"
}

status() {
    local name pid state
    for f in "$DIR"/redis-*/pid "$DIR"/replica-*/pid "$DIR"/nginx/pid; do
        [[ -f "$f" ]] || continue
        name="$(basename "$(dirname "$f")")"
        pid="$(cat "$f")"
        state=stopped
        kill -0 "$pid" 2>/dev/null && state="running"
        printf '%-14s pid %-8s %s\n' "$name" "$pid" "$state"
    done
    [[ -f "$DIR/cluster.env" ]] && cat "$DIR/cluster.env" || echo "not up (no $DIR/cluster.env)"
}

case "$CMD" in
    up)
        [[ "$REPLICAS" =~ ^[1-9][0-9]*$ ]] || die "--replicas must be a positive integer"
        [[ -x "$CHATSTORE_BIN" ]] || die "$CHATSTORE_BIN not found (make install first)"
        command -v redis-server >/dev/null || die "redis-server is not installed"
        [[ -x "$NGINX" ]] || die "nginx is not installed"
        [[ -f "$DIR/cluster.env" ]] && die "already up ($DIR/cluster.env); run down first"
        mkdir -p "$DIR"
        # Any failure below (die exits too) stops whatever had started.
        trap 'echo "cluster.sh: start failed, stopping what started" >&2; down >&2' EXIT
        start_redis
        start_replicas
        start_nginx
        write_env
        trap - EXIT
        cat "$DIR/cluster.env"
        ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status [--replicas N] [--dir DIR]" >&2; exit 2 ;;
esac
