#!/usr/bin/env bash
# Runs every dlock test against real servers. On a fresh Debian machine it
# first installs what is missing (redis-server), so this one command is all
# a new checkout needs. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
redis-server --version

# The Debian package starts a system redis on 6379; the tests start their
# own servers on free ports and never use it.
cargo test --workspace "$@"
