"""In-process extraction throughput on a GPU (needs CUDA): ``hsdata.engine_hf.extract`` with a Llama-3-8B-shaped
model (random bf16 weights) against the same forwards without capture, in the same run.

    python benchmarks/extract_bench.py --out /tmp/hs-extract --tokens 400000
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time

import torch

import hsdata
from hook_overhead_bench import build_model
from hsdata import engine_hf
from hsdata.conversations import Record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=400_000)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    args = parser.parse_args()
    rng = random.Random(0)
    records, total = [], 0
    while total < args.tokens:
        n = rng.randint(256, 4096)
        records.append(Record(f"s{len(records):06d}", input_ids=[rng.randrange(128256) for _ in range(n)]))
        total += n
    model = build_model()
    batches = list(engine_hf.batches_by_length([(r.sample_id, r.input_ids) for r in records], args.max_batch_tokens))

    def forward_only() -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                ids, mask = engine_hf.pad_batch(batch)
                model(input_ids=ids.cuda(), attention_mask=mask.cuda(), use_cache=False)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    forward_only()  # warm-up
    baseline = forward_only()
    shutil.rmtree(args.out, ignore_errors=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    summary = engine_hf.extract(model, None, records, args.out, model_name="random/llama-3-8b",
                                max_batch_tokens=args.max_batch_tokens)
    seconds = time.perf_counter() - started  # ends when every sample is committed
    store = hsdata.open(args.out)
    written = store.num_tokens * store.spec.token_nbytes
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(), "samples": len(records), "tokens": total, "ok": summary.ok,
        "forward_only_s": baseline, "extract_s": seconds,
        "forward_only_tokens_per_s": total / baseline, "extract_tokens_per_s": total / seconds,
        "written_gb_per_s": written / seconds / 1e9, "bytes_written": written,
        "share_outside_forward": 1 - baseline / seconds,
    }, indent=2))


if __name__ == "__main__":
    main()
