#!/usr/bin/env bash
# Headless Chromium for tests/e2e/test_transcripts_page.py (the `analyze --transcripts --html`
# page, screenshotted and its DOM dumped) and scripts/transcripts_figure.py. Debian's
# `chromium`, installed with apt-get when missing and we are root (CI runs as root on a
# clean Debian machine); otherwise one line says so and the test skips (fails under CI=true).
# Idempotent: <0.1 s when chromium is there. Called by scripts/setup.sh.
#   bash scripts/setup_chromium.sh
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "[setup] chromium missing and not root with apt-get: the transcripts page test skips (fails under CI)"
  exit 0
fi
echo "[setup] installing chromium (apt-get, Debian's) for the transcripts page test"
export DEBIAN_FRONTEND=noninteractive
t0=$(date +%s)
# no recommends (upower, udev, mesa, a notification daemon): headless needs none of them;
# libfontconfig1's fontconfig-config pulls a font (fonts-dejavu-core), which the page needs
log=$(mktemp)
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; } >"$log" 2>&1; then
  cat "$log" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"
echo "[setup] chromium installed in $(( $(date +%s) - t0 )) s: $(chromium --version 2>/dev/null || echo '?')"
