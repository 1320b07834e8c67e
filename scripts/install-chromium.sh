#!/usr/bin/env bash
# Install Debian's headless-capable Chromium for the UI test (tests/ui/), if it is not there yet.
# Idempotent: does nothing when `chromium` is already on PATH. Needs root (apt-get); the machine's
# package mirror is the only network access it uses.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
command -v chromium >/dev/null
