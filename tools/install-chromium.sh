#!/usr/bin/env bash
# Make sure Debian's chromium is at /usr/bin/chromium: the browser test drives it headless
# through Playwright (no `playwright install`, no download of a browser build).
# As root it installs the Debian package with apt; otherwise it says what to install.
set -euo pipefail

CHROMIUM=/usr/bin/chromium  # the path the browser test launches

if [ -x "$CHROMIUM" ]; then
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "error: $CHROMIUM is missing; the browser test needs Debian's chromium." >&2
    echo "       install it with:  sudo apt-get install -y --no-install-recommends chromium" >&2
    exit 1
fi

echo "Installing Debian's chromium with apt-get (once) ..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium </dev/null
test -x "$CHROMIUM" || { echo "error: apt installed chromium but $CHROMIUM is missing" >&2; exit 1; }
"$CHROMIUM" --version
