#!/usr/bin/env bash
# Installs what the build and the tests need on a fresh Debian machine, and
# nothing that is already there: redis-server, zookeeper (with a Java runtime),
# postgresql, and what the `tls` feature links and its tests run.
set -euo pipefail

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
[ -f /usr/share/java/zookeeper.jar ] || need+=(zookeeper)     # brings a Java runtime
# PostgreSQL for the `postgres` backend's tests: initdb and pg_ctl from
# /usr/lib/postgresql/<version>/bin (no cluster of the package's is used).
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need+=(postgresql)
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
ls -d /usr/lib/postgresql/*/bin | tail -1

