#!/usr/bin/env bash
# Installs what the build and the tests need on a fresh Debian machine, and
# nothing that is already there: redis-server, zookeeper (with a Java runtime),
# postgresql, and what the `tls` feature links and its tests run.
set -euo pipefail
# A failure inside $(...) (fetch_pgbouncer) stops the script too.
shopt -s inherit_errexit

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
# scripts/parallel-tests.sh reads cargo's build messages with jq.
command -v jq >/dev/null 2>&1 || need+=(jq)
# PgBouncer for the transaction-pool tests: Debian 12 ships 1.18, which
# cannot keep sqlx's prepared statements in transaction mode (1.21 can). It
# is built below from Debian 13's source (a C program, seconds to build),
# with libevent's headers and make.
pgbouncer_ok() {
  local v
  v=$(/usr/local/bin/pgbouncer --version 2>/dev/null | sed -n 's/^PgBouncer \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  [ -n "$v" ] && set -- $v && { [ "$1" -gt 1 ] || [ "$2" -ge 21 ]; }
}
if ! pgbouncer_ok; then
  pkg-config --exists libevent 2>/dev/null || need+=(libevent-dev)
  command -v make >/dev/null 2>&1 || need+=(make)
  command -v curl >/dev/null 2>&1 || need+=(curl)
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# PgBouncer's source into $1, as pgbouncer-<version>/: the pinned tarball,
# checked by its SHA-256; when Debian's pool no longer has it (Debian 13
# moved to a later upstream version), the one Debian 13 lists now, found in
# its signed source index (InRelease, checked with the archive keyring,
# which carries Debian 13's keys) and checked by the SHA-256 listed there.
fetch_pgbouncer() {
  local dir=$1 pool=http://deb.debian.org/debian
  local version=1.24.1 sha256=da72a3aba13072876d055a3e58dd4aba4a5de4ed6148e73033185245598fd3e0
  if ! curl -fsSL --retry 3 -o "$dir/pgbouncer.tar.gz" "$pool/pool/main/p/pgbouncer/pgbouncer_${version}.orig.tar.gz"; then
    echo "PgBouncer $version is gone from Debian's pool: taking Debian 13's from its signed index" >&2
    curl -fsSL --retry 3 -o "$dir/InRelease" "$pool/dists/trixie/InRelease"
    gpgv --keyring /usr/share/keyrings/debian-archive-keyring.gpg --output "$dir/Release" "$dir/InRelease" 2>/dev/null
    local listed
    listed=$(awk '/^SHA256:/ {on = 1; next} /^[^ ]/ {on = 0} on && $3 == "main/source/Sources.gz" {print $1}' "$dir/Release")
    curl -fsSL --retry 3 -o "$dir/Sources.gz" "$pool/dists/trixie/main/source/Sources.gz"
    echo "$listed  $dir/Sources.gz" | sha256sum -c --quiet
    # The stanza of pgbouncer: its orig tarball's SHA-256 and name.
    read -r sha256 orig < <(gzip -dc "$dir/Sources.gz" | awk -v RS= '/(^|\n)Package: pgbouncer\n/' |
      awk '/^Checksums-Sha256:/ {on = 1; next} /^[^ ]/ {on = 0} on && $3 ~ /\.orig\.tar\.gz$/ {print $1, $3; exit}')
    version=${orig#pgbouncer_}
    version=${version%.orig.tar.gz}
    curl -fsSL --retry 3 -o "$dir/pgbouncer.tar.gz" "$pool/pool/main/p/pgbouncer/$orig"
  fi
  echo "$sha256  $dir/pgbouncer.tar.gz" | sha256sum -c --quiet
  tar -xzf "$dir/pgbouncer.tar.gz" -C "$dir"
  echo "$version"
}
if ! pgbouncer_ok; then
  src=$(mktemp -d)
  version=$(fetch_pgbouncer "$src")
  echo "building PgBouncer $version into /usr/local/bin"
  (
    cd "$src/pgbouncer-$version"
    ./configure -q --prefix=/usr/local --without-cares --with-pam=no >/dev/null
    make -s -j2 >/dev/null
  )
  $SUDO install -m 755 "$src/pgbouncer-$version/pgbouncer" /usr/local/bin/pgbouncer
  rm -rf "$src"
fi
redis-server --version
/usr/local/bin/pgbouncer --version | head -1
java -version 2>&1 | head -1
ls -d /usr/lib/postgresql/*/bin | tail -1

