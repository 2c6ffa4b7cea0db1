#!/usr/bin/env bash
# Runs the HTTP benchmark with the documented settings and redraws its figures:
#
#   bash docs/benchmarks/run.sh [more bench-http flags, e.g. --scenarios first,replay]
#
# Writes docs/benchmarks/latest.json (bench-http --json) and latest.md (its Markdown tables),
# then docs/benchmarks/ratios.svg and the ratios table of BENCHMARKS.md (docs/benchmarks/
# chart.py). Every store bench-http measures by default: memory, SQLite, PostgreSQL
# ($DATABASE_URL; skipped without it), MySQL/MariaDB ($MYSQL_URL, else
# mysql://root@127.0.0.1:3306/test) and Redis ($REDIS_URL, else redis://127.0.0.1:6379).
# With $REDIS_CLUSTER_URL (redis+cluster://host:port,…) a second run measures the Redis store
# on that cluster into latest-cluster.json and latest-cluster.md (not when the flags choose
# --stores). The flags go to both runs.
#
# About 30 minutes on the 2 vCPU machine of BENCHMARKS.md (4 more with a cluster), plus the
# release build. Run it on a quiet machine: the ratios are medians of one run, and anything
# else running moves them.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=docs/benchmarks
start=$(date +%s)

cargo build --release -p idempotent-examples --bin bench-http
bin="${CARGO_TARGET_DIR:-target}/release/bench-http"

# Into temporary files first: a run that fails its checks leaves the committed figures alone.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" --json "$tmp/latest.json" --out "$tmp/latest.md" "$@"
inputs=("$dir/latest.json")
cluster="${REDIS_CLUSTER_URL:-}"
case " $* " in
    *" --stores"*) cluster="" ;; # a chosen set of stores: no second run
esac
if [ -n "$cluster" ]; then
    "$bin" --stores redis --redis "$cluster" \
        --json "$tmp/latest-cluster.json" --out "$tmp/latest-cluster.md" "$@"
fi
mv "$tmp/latest.json" "$tmp/latest.md" "$dir/"
if [ -n "$cluster" ]; then
    mv "$tmp/latest-cluster.json" "$tmp/latest-cluster.md" "$dir/"
    inputs+=("$dir/latest-cluster.json")
else
    # Figures of an earlier cluster run would be drawn beside this run's as if they were one.
    rm -f "$dir/latest-cluster.json" "$dir/latest-cluster.md"
fi

python3 "$dir/chart.py" "${inputs[@]}" -o "$dir/ratios.svg" --table-into BENCHMARKS.md --check
echo "run.sh: $(( ($(date +%s) - start) / 60 )) minutes; review and commit:" \
    "BENCHMARKS.md $dir/ratios.svg $dir/latest.*"
