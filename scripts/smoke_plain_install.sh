#!/usr/bin/env bash
# CI: install hsdata with no extras into a fresh venv and check that it imports and its commands work there, so
# the core dependencies cover every import of the core (http/s3 are extras: they must fail with a clear message).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --no-compile "torch==2.14.1"  # the pinned torch first, as setup.sh does
"$py" -m pip install -q --no-compile . "torch==2.14.1"
cd "$work"
"$py" -c "import hsdata"
"$work/venv/bin/hsdata" --version
"$work/venv/bin/hsdata" extract --out store
"$work/venv/bin/hsdata" info store
"$work/venv/bin/hsdata" validate store
"$py" - <<'PY'
import hsdata

with hsdata.open("store") as store:
    sample = store.get("demo-017")
    assert sample["hidden_states"].shape == (len(sample["input_ids"]), store.spec.hidden_size)
for url, extra in [("http://127.0.0.1:9/store", "http"), ("s3://bucket/store", "s3")]:
    try:
        hsdata.open(url)
    except hsdata.MissingExtraError as e:
        assert f"pip install 'hsdata[{extra}]'" in str(e), e
    else:
        raise AssertionError(f"{url} opened without hsdata[{extra}]")
print("plain install: OK")
PY
