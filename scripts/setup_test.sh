#!/usr/bin/env bash
# System packages that only some tests need, on top of scripts/setup.sh's. scripts/test.sh runs it when
# the selected tests include those groups (all of them for the whole suite).
#
#   bash scripts/setup_test.sh [--dry-run] GROUP...
#
# Groups:
#   browser   chromium: the headless browser of the browser tests (tests/browser/, marker `browser`),
#             an 81 MB download plus the libraries it depends on (many on a minimal system: X11, fonts,
#             ...); Playwright itself comes with duplexkit[all].
#
# Installs the missing ones as root or through sudo, saying which first (scripts/lib_apt.sh).
# DUPLEXKIT_SKIP_APT=1 checks and installs nothing. Exit status: 0 done; 1 they could not be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib_apt.sh

APT_BROWSER=(
  chromium
)
for arg in "$@"; do
  case $arg in
    --dry-run) export APT_DRY_RUN=1 ;;
    browser) apt_ensure "the browser tests" "${APT_BROWSER[@]}" ;;
    *) echo "[setup] error: unknown group or option $arg (groups: browser; option: --dry-run)" >&2; exit 1 ;;
  esac
done
