#!/usr/bin/env bash
# Create .venv and install hsdata with its test dependencies. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned to the release SGLang 0.5.23's modules import with (server_hook tests); an unpinned torch
# may pull several GB of CUDA wheels.
.venv/bin/python -m pip install -q "torch==2.14.1"
.venv/bin/python -m pip install -q -e ".[test,sglang-test,specforge]" "torch==2.14.1"
# The real SGLang, for the server hook's contract and end-to-end tests (a real launch_server on the CPU, see
# tests/sglang_server.py); --no-deps: its full requirements need a GPU stack.
.venv/bin/python -m pip install -q --no-deps "sglang==0.5.23"
# The real SpecForge, for hsdata.integrations.specforge's test (tests/test_specforge.py trains with SpecForge's own
# trainer on the CPU); --no-deps: its pins (torch 2.11.0, transformers 5.8.1, sglang 0.5.14) would replace the
# ones above, and its offline path runs on these.
.venv/bin/python -m pip install -q --no-deps "specforge==0.2.0"
