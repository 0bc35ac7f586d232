#!/usr/bin/env bash
# Runs every test binary of the workspace (built with --all-features) and the
# doctests, several at once, as `cargo test --workspace --all-features
# --no-fail-fast` would run them one after another: same binaries, same
# working directory and CARGO_* variables, every test of every binary.
#
# Why: most of the suite waits on real servers (leases running out, sessions
# expiring, a torture run's workers), so one binary after another leaves the
# cores idle; run side by side, the suite takes about half as long. Each
# binary still runs its own tests on its own threads, as under cargo.
#
#   DLOCK_TEST_JOBS=N   binaries at once (default 2: one per core here; at 3 the
#                       timing tests of the PostgreSQL and ZooKeeper suites
#                       missed their leases on a loaded 2-core machine)
#   arguments           passed to every test binary (a name filter, --nocapture)
#
# Output: one line per binary as it ends (time, result), then the whole
# output of every binary that failed; the exit status is 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${DLOCK_TEST_JOBS:-2}
target=$(cargo metadata --format-version 1 --no-deps | jq -r .target_directory)
logs="$target/test-logs"
rm -rf "$logs"
mkdir -p "$logs"

# Every test binary, built once: executable, package directory, package
# name and version, and the binary's name, from cargo's own build messages.
list="$logs/binaries.tsv"
cargo test --workspace --all-features --no-run --message-format=json-render-diagnostics |
  jq -r 'select(.reason == "compiler-artifact" and .executable != null and .profile.test)
         | (.manifest_path | sub("/Cargo.toml$"; "")) as $dir
         | (.package_id | capture("#(?:(?<n>[^@]+)@)?(?<v>[^#]*)$")) as $id
         | [.executable, $dir, ($id.n // ($dir | split("/") | last)), $id.v, .target.name]
         | @tsv' >"$list"
[ -s "$list" ] || { echo "no test binary was built" >&2; exit 1; }

# The slowest binaries start first (measured on 2 cores), so the run ends
# soon after its longest one; the rest follow in cargo's order.
slow=(short_run postgres_backend zookeeper_backend restart_quarantine redlock_faults wallet
      redlock_backend idempotency redis_backend zookeeper_partition smoke)
order="$logs/order.tsv"
{
  for name in "${slow[@]}"; do awk -F'\t' -v n="$name" '$5 == n' "$list"; done
  awk -F'\t' -v s=" ${slow[*]} " 'index(s, " " $5 " ") == 0' "$list"
} >"$order"

cargo_bin=$(command -v cargo)
# As cargo does for a test: the toolchain's own libraries on the library
# path (a proc-macro crate's test binary links libstd dynamically).
sysroot=$(rustc --print sysroot)
host=$(rustc -vV | sed -n 's/^host: //p')
export LD_LIBRARY_PATH="$target/debug/deps:$sysroot/lib/rustlib/$host/lib:$sysroot/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# One binary: run from its package's directory with the variables cargo
# gives a test at run time; its output into a log, its result into a line.
run_one() {
  local exe=$1 dir=$2 pkg=$3 version=$4 name=$5 log start status
  log="$logs/$pkg.$name.$(basename "$exe").log"
  start=$(date +%s)
  status=0
  (cd "$dir" && CARGO="$cargo_bin" CARGO_MANIFEST_DIR="$dir" CARGO_PKG_NAME="$pkg" CARGO_PKG_VERSION="$version" \
    CARGO_CRATE_NAME="${pkg//-/_}" "$exe" "${@:6}") >"$log" 2>&1 || status=$?
  printf '%4ss  %-8s %s %s\n' "$(($(date +%s) - start))" "$([ $status -eq 0 ] && echo ok || echo FAILED)" "$pkg" "$name"
  [ $status -eq 0 ] || echo "$log" >>"$logs/failed"
}

# The doctests: rustdoc builds and runs each, so cargo runs them.
run_doc() {
  local log="$logs/doctests.log" start status=0
  start=$(date +%s)
  cargo test --workspace --all-features --doc -- "$@" >"$log" 2>&1 || status=$?
  printf '%4ss  %-8s doctests\n' "$(($(date +%s) - start))" "$([ $status -eq 0 ] && echo ok || echo FAILED)"
  [ $status -eq 0 ] || echo "$log" >>"$logs/failed"
}

began=$(date +%s)
running=0
while IFS=$'\t' read -r exe dir pkg version name; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_one "$exe" "$dir" "$pkg" "$version" "$name" "$@" &
  running=$((running + 1))
done <"$order"
if [ "$running" -ge "$jobs" ]; then
  wait -n || true
fi
run_doc "$@" &
wait

count=$(wc -l <"$order")
echo "$count test binaries and the doctests in $(($(date +%s) - began)) s, $jobs at a time"
if [ -s "$logs/failed" ]; then
  while read -r log; do
    echo
    echo "=============== $log"
    cat "$log"
  done <"$logs/failed"
  echo
  echo "FAILED: $(wc -l <"$logs/failed") of $((count + 1)); logs in $logs"
  exit 1
fi
