#!/usr/bin/env bash
# Instructions per request of one bench-http server arm, counted by callgrind (see README.md
# here): the server runs under valgrind, takes WARMUP requests on one keep-alive connection,
# then the counters are zeroed, REQUESTS more are sent, and the counts are dumped.
#
#   examples/callgrind/instructions.sh BENCH_HTTP FRAMEWORK ARM [first|replay] [REQUESTS] [OUT]
#
# BENCH_HTTP is a release build of bench-http; FRAMEWORK is axum or actix; ARM is bare or plain
# (memory store). Prints the dump's file and its summary; compare two dumps with
# `callgrind.py diff`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin=$1 framework=$2 arm=$3 scenario=${4:-first} requests=${5:-1000}
out=${6:-callgrind.$framework.$arm.$scenario}
warmup=300
command -v valgrind >/dev/null || { echo "instructions.sh: valgrind is not installed" >&2; exit 1; }
work=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
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
# Replays go to one key, executed during the warm-up; first executions each get a new key.
prefix=$([ "$scenario" = replay ] && echo measured || echo warmup)
python3 "$here/callgrind.py" drive "$addr" "$warmup" "$prefix" "$scenario"
callgrind_control -z "$pid" >/dev/null
python3 "$here/callgrind.py" drive "$addr" "$requests" measured "$scenario"
callgrind_control -d measured "$pid" >/dev/null
for _ in $(seq 1 60); do
    dump=$(ls "$work"/cg.*.1 2>/dev/null || true)
    [ -n "$dump" ] && grep -q '^totals:' "$dump" && break
    sleep 0.5
done
[ -n "$dump" ] || { echo "instructions.sh: callgrind wrote no dump" >&2; exit 1; }
cp "$dump" "$out"
echo "$out"
python3 "$here/callgrind.py" summary "$out" "$requests"
