#!/usr/bin/env bash
# Install the server binaries the tests start (Debian packages), if they are missing.
# Needs root (or sudo) for apt-get; says clearly what is missing when it cannot install.
set -euo pipefail

need=()
command -v redis-server   >/dev/null || need+=(redis-server)
command -v redis-sentinel >/dev/null || need+=(redis-sentinel)
command -v etcd           >/dev/null || need+=(etcd-server)
command -v chromium       >/dev/null || need+=(chromium)
command -v faketime       >/dev/null || need+=(faketime)
command -v openssl        >/dev/null || need+=(openssl)   # throwaway CA for the TLS tests

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "install-servers: missing ${need[*]} and not root: install them with apt-get" >&2
    exit 1
  fi
fi
echo "install-servers: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null || true
if ! $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; then
  echo "install-servers: apt-get could not install: ${need[*]}" >&2
  exit 1
fi
