#!/usr/bin/env bash
# Runs every dlock test against real servers. On a fresh Debian machine it
# first installs what is missing (redis-server, zookeeper, postgresql), so this one command is all
# a new checkout needs. Extra arguments go to every test binary (a name
# filter, --nocapture).
set -euo pipefail
cd "$(dirname "$0")/.."

bash "$(dirname "$0")/install-deps.sh"

# The Debian package starts a system redis on 6379; the tests start their
# own servers on free ports and never use it.
# --all-features: the optional backends (ZooKeeper, PostgreSQL) and TLS (`rediss://`) are tested too.
# What `cargo test --workspace --all-features --no-fail-fast` runs, the test
# binaries side by side (scripts/parallel-tests.sh says why and how).
bash "$(dirname "$0")/parallel-tests.sh" "$@"

# What a build without TLS promises (a `rediss://` URL is a start-up error
# naming the `tls` feature, not a plain-text connection) is tested under
# `#[cfg(not(feature = "tls"))]`, which --all-features never compiles: one
# narrow pass without the feature runs those tests, and the one that pins a
# backend whose feature is off (ZooKeeper here) as the first error reported.
cargo test -p dlock-core --no-fail-fast --features test-support --lib --test redis_backend -- tls without_its_feature
