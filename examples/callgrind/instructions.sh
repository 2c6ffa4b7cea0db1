#!/usr/bin/env bash
# Instructions per request of one bench-http server arm, counted by callgrind (see README.md
# here): the server runs under valgrind; on one keep-alive connection it takes 300 warm-up
# requests, the counters are zeroed, it takes REQUESTS more, and the counts are dumped.
#
#   examples/callgrind/instructions.sh BENCH_HTTP FRAMEWORK ARM [first|replay] [REQUESTS] [OUT]
#
# BENCH_HTTP is a release build of bench-http; FRAMEWORK is axum or actix; ARM is bare or plain
# (memory store). Prints the dump's file and its summary; compare two dumps with
# `callgrind.py diff`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ $# -lt 3 ]; then
    sed -n '6p' "$0" >&2
    exit 2
fi
bin=$1 framework=$2 arm=$3 scenario=${4:-first} requests=${5:-1000}
out=${6:-callgrind.$framework.$arm.$scenario}
case "$scenario" in first | replay) ;; *) echo "instructions.sh: first or replay, not $scenario" >&2; exit 2 ;; esac
command -v valgrind >/dev/null || { echo "instructions.sh: valgrind is not installed" >&2; exit 1; }
work=$(mktemp -d)
pid=
cleanup() {
    if [ -n "$pid" ]; then
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
valgrind --tool=callgrind --callgrind-out-file="$work/cg.%p" ${CALLGRIND_OPTS:-} \
    "$bin" serve --framework "$framework" --arm "$arm" --database memory --tag cg \
    >"$work/stdout" 2>"$work/stderr" &
pid=$!
for _ in $(seq 1 240); do
    grep -q '^listening on ' "$work/stdout" && break
    kill -0 "$pid" 2>/dev/null || { cat "$work/stderr" >&2; exit 1; }
    sleep 0.5
done
addr=$(sed -n 's/^listening on //p' "$work/stdout" | head -n 1)
[ -n "$addr" ] || { echo "instructions.sh: the server never listened" >&2; exit 1; }
python3 "$here/callgrind.py" measure "$addr" "$pid" 300 "$requests" "$scenario"
# The dump of the measured requests is cg.<pid>.1, complete once its `totals:` line is written.
dump="$work/cg.$pid.1"
for _ in $(seq 1 120); do
    [ -f "$dump" ] && grep -q '^totals:' "$dump" && break
    sleep 0.5
done
grep -q '^totals:' "$dump" 2>/dev/null || { echo "instructions.sh: no complete dump ($dump)" >&2; exit 1; }
cp "$dump" "$out"
echo "$out"
python3 "$here/callgrind.py" summary "$out" "$requests"
