#!/usr/bin/env bash
# Run the test suite on this machine, from nothing: sets up .venv (scripts/setup.sh),
# makes sure a Redis is there for the tests, runs the static checks (scripts/check.sh:
# ruff, mypy, import contracts) and builds the docs with their link check (scripts/docs.sh)
# when no arguments are given, then pytest with any arguments:
#   bash scripts/test.sh                      # everything, in several pytest processes (below)
#   bash scripts/test.sh tests/cli/test_cli.py -x # a selection, in this one process
# The whole suite runs in GPUFEED_TEST_PROCESSES pytest processes (pytest-xdist; default: the
# cores, at most 4; 1: this process only), each test file in one of them, since most of the
# time is spent waiting on Redis, the S3 server, workers and subprocesses.
# Redis: GPUFEED_TEST_REDIS_URL if set (a loopback address), else a private redis-server
# on a free 127.0.0.1 port, without persistence, stopped when this script exits.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"

bash scripts/setup.sh

REDIS_DIR=""
stop_redis() {
    [[ -n "$REDIS_DIR" ]] || return 0
    local pid
    pid="$(cat "$REDIS_DIR/redis.pid" 2>/dev/null || true)"
    if [[ -n "$pid" ]] && kill "$pid" 2>/dev/null; then
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
    fi
    rm -rf "$REDIS_DIR"
    REDIS_DIR=""
}
trap stop_redis EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

redis_answers() {  # URL -> exit 0 once a Redis answers there (waits up to 5 s)
    "$PY" - "$1" <<'PYEOF'
import sys, time
import redis

client = redis.Redis.from_url(sys.argv[1], socket_connect_timeout=0.5, socket_timeout=0.5)
deadline = time.monotonic() + 5
while True:
    try:
        sys.exit(0 if client.ping() else 1)
    except redis.exceptions.ConnectionError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.05)
PYEOF
}

redacted_test_redis_url() {  # the project's own redaction; the URL is read from the environment, never from argv
    "$PY" -c 'import os; from pipeline.io.fs import redact_url; print(redact_url(os.environ["GPUFEED_TEST_REDIS_URL"]))'
}

start_private_redis() {
    local port url
    for _ in 1 2 3 4 5; do  # another process may take the port between choosing and binding it
        REDIS_DIR="$(mktemp -d -t gpufeed-redis.XXXXXX)"
        port="$(free_port)"
        url="redis://127.0.0.1:$port/0"
        redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
            --daemonize yes --pidfile "$REDIS_DIR/redis.pid" --dir "$REDIS_DIR" \
            --logfile "$REDIS_DIR/redis.log" >/dev/null
        if redis_answers "$url"; then
            export GPUFEED_TEST_REDIS_URL="$url"
            echo "test: private redis-server at $url (pid $(cat "$REDIS_DIR/redis.pid"))"
            return 0
        fi
        cat "$REDIS_DIR/redis.log" >&2 || true
        stop_redis
    done
    echo "test: could not start redis-server; tests that need Redis will be skipped" >&2
}

if [[ -n "${GPUFEED_TEST_REDIS_URL:-}" ]]; then
    echo "test: using GPUFEED_TEST_REDIS_URL=$(redacted_test_redis_url)"
elif command -v redis-server >/dev/null 2>&1; then
    start_private_redis
else
    echo "test: redis-server not found; tests that need Redis will be skipped" >&2
fi

test_processes() {
    if [[ -n "${GPUFEED_TEST_PROCESSES:-}" ]]; then
        echo "$GPUFEED_TEST_PROCESSES"
        return
    fi
    local cores
    cores="$("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))')"
    echo $((cores < 4 ? cores : 4))
}

status=0
args=("$@")
if [[ $# == 0 ]]; then  # the whole suite: the static checks and the docs first (a selection skips them)
    processes="$(test_processes)"
    if ! [[ "$processes" =~ ^[1-9][0-9]*$ ]]; then
        echo "test: GPUFEED_TEST_PROCESSES must be a whole number of processes (1 or more), got '$processes'" >&2
        exit 2
    fi
    bash scripts/check.sh || status=$?
    bash scripts/docs.sh || status=$?
    if [[ "$processes" -gt 1 ]]; then
        args=(-n "$processes" --dist loadfile)
        echo "test: $processes pytest processes (GPUFEED_TEST_PROCESSES=1: one)"
    fi
fi
"$PY" -m pytest "${args[@]}" || status=$?
if [[ "$status" == 5 ]]; then
    echo "test: FAILED: pytest collected no tests (exit code 5); check the paths and -k/-m filters" >&2
fi
exit "$status"
