#!/usr/bin/env bash
# Install Debian's headless-capable Chromium and its WebDriver (chromedriver) for the browser tests
# in tests/ui/ (driven by selenium), if they are not there yet. Idempotent: does nothing when both
# `chromium` and `chromedriver` are on PATH. Needs root (apt-get); the machine's package mirror is
# the only network access it uses (selenium is given both paths and never downloads a driver).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-dejavu-core
command -v chromium >/dev/null
command -v chromedriver >/dev/null
