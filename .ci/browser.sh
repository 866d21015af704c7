#!/usr/bin/env bash
# Headless Chromium for the chat-page browser test (tests/server/test_chat_page.py).
#   bash .ci/browser.sh install   # idempotent, non-interactive
# Debian's chromium is used as is; no test tool downloads a browser of its own. The Python
# driver (playwright) is pinned in pyproject.toml's `test` extra and only drives this binary.
set -euo pipefail

case "${1:-install}" in
  install)
    if [ -x /usr/bin/chromium ]; then
      echo "chromium: $(/usr/bin/chromium --version 2>/dev/null || echo present)"
      exit 0
    fi
    SUDO=""
    if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
    echo "chromium: $(/usr/bin/chromium --version)"
    ;;
  *)
    echo "usage: $0 install" >&2
    exit 2
    ;;
esac
