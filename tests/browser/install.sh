#!/usr/bin/env bash
# Installs what the browser test needs outside .venv, once: Debian's chromium and its matching
# chromedriver (Selenium drives that pair; it never downloads a browser) and a CJK font so the
# lessons' Chinese renders. Already there: does nothing.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if have chromium && have chromedriver && have fc-list && [ -n "$(fc-list :lang=zh)" ]; then
    exit 0
fi
if ! have apt-get; then
    echo "browser-test: install chromium, its chromedriver and a CJK font (Debian: apt-get install chromium chromium-driver fonts-noto-cjk), then rerun" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if ! have sudo; then
        echo "browser-test: not root and no sudo; as root run: apt-get install -y chromium chromium-driver fonts-noto-cjk" >&2
        exit 1
    fi
    SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q chromium chromium-driver fonts-noto-cjk fontconfig
