#!/usr/bin/env bash
# Runs every dlock test against real servers. On a fresh Debian machine it
# first installs what is missing (redis-server, zookeeper), so this one command is all
# a new checkout needs. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
[ -f /usr/share/java/zookeeper.jar ] || need+=(zookeeper)     # brings a Java runtime
# The `tls` feature (built by --all-features) links the system OpenSSL through
# native-tls: its build needs pkg-config and libssl-dev; the TLS tests make
# their certificates with the openssl tool.
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
pkg-config --exists openssl 2>/dev/null || need+=(libssl-dev)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
redis-server --version
java -version 2>&1 | head -1

# The Debian package starts a system redis on 6379; the tests start their
# own servers on free ports and never use it.
# --all-features: the optional backends (ZooKeeper) and TLS (`rediss://`) are tested too.
cargo test --workspace --all-features --no-fail-fast "$@"
