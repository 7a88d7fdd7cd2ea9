#!/usr/bin/env bash
# Create .venv and install hsdata with its test dependencies. Safe to re-run. Each step says what it installs,
# then how long it took (about 3 minutes in all on a fresh machine, most of it torch).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() {  # step "what" command...: one line before, one after with the seconds it took
    local what=$1 at=$SECONDS
    shift
    echo "setup: $what ..."
    "$@"
    echo "setup: $what: done in $((SECONDS - at)) s"
}
[ -x .venv/bin/python ] || step "a virtual environment in .venv" python3 -m venv .venv
step "pip" .venv/bin/python -m pip install -q --upgrade pip
# torch is pinned to the release SGLang 0.5.23's modules import with (server_hook tests); an unpinned torch
# may pull several GB of CUDA wheels.
step "torch 2.14.1 (about 5.5 GB, from this machine's wheel cache where it has one)" \
    .venv/bin/python -m pip install -q "torch==2.14.1"
step "hsdata (editable) with its test, SGLang-test and SpecForge dependencies" \
    .venv/bin/python -m pip install -q -e ".[test,sglang-test,specforge]" "torch==2.14.1"
# The real SGLang, for the server hook's contract and end-to-end tests (a real launch_server on the CPU, see
# tests/sglang_server.py); --no-deps: its full requirements need a GPU stack.
step "sglang 0.5.23 (no dependencies: the ones above)" .venv/bin/python -m pip install -q --no-deps "sglang==0.5.23"
# The real SpecForge, for hsdata.integrations.specforge's test (tests/test_specforge.py trains with SpecForge's own
# trainer on the CPU); --no-deps: its pins (torch 2.11.0, transformers 5.8.1, sglang 0.5.14) would replace the
# ones above, and its offline path runs on these.
step "specforge 0.2.0 (no dependencies)" .venv/bin/python -m pip install -q --no-deps "specforge==0.2.0"
echo "setup: done in $((SECONDS - started)) s; run the tests with .venv/bin/python -m pytest -q"
