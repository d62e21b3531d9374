#!/bin/sh
# Start `wasibox serve` on a loopback port, call it with curl, stop it.
# Usage: sh examples/service_curl/call.sh   (needs the 'serve' extra and curl)
# WASIBOX names the command to start (default: wasibox), PORT the port (default: 8080).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
port=${PORT:-8080}
token=example-token-change-me
log=$(mktemp)  # the server's per-run log lines, shown if it does not start
${WASIBOX:-wasibox} serve --config "$here/wasibox.toml" --host 127.0.0.1 --port "$port" \
    2>"$log" &
server=$!
trap 'kill "$server" 2>/dev/null; rm -f "$log"' EXIT
tries=0
until curl -fs "http://127.0.0.1:$port/healthz" >/dev/null; do
    tries=$((tries + 1))
    if [ "$tries" -gt 300 ]; then echo "the server did not start:" >&2; cat "$log" >&2; exit 1; fi
    sleep 0.1
done

echo "POST /v1/run:"
curl -fsS "http://127.0.0.1:$port/v1/run" -H "Authorization: Bearer $token" \
    -H 'Content-Type: application/json' -d '{"code": "print(sum(range(10)))"}'
echo
echo "POST /v1/call:"
curl -fsS "http://127.0.0.1:$port/v1/call" -H "Authorization: Bearer $token" \
    -H 'Content-Type: application/json' \
    -d '{"code": "def area(w, h):\n    return w * h", "entry": "area", "args": [6, 7]}'
echo
echo "without a token:"
curl -sS -o /dev/null -w '%{http_code}\n' "http://127.0.0.1:$port/v1/run" \
    -H 'Content-Type: application/json' -d '{"code": "print(1)"}'
