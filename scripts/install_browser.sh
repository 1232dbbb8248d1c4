#!/usr/bin/env bash
# Headless Chromium + chromedriver (Debian packages) and Selenium, for the viewer's browser test
# (tests/test_viewer_browser.py). Idempotent: does nothing that is already done.
set -euo pipefail

need_apt=0
command -v chromium >/dev/null 2>&1 || need_apt=1
command -v chromedriver >/dev/null 2>&1 || need_apt=1
if [ "$need_apt" = 1 ]; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver fonts-dejavu-core
fi
python -c "import selenium" 2>/dev/null || python -m pip install -q "selenium>=4.15"
chromium --version
chromedriver --version
