"""In-process extraction throughput on a GPU (needs CUDA): ``hsdata.extract.engine_hf.extract`` with a Llama-3-8B-shaped
model (random bf16 weights) against the same forwards without capture, in the same run.

The time outside the forward is split into: before the first forward (store creation), the forward loop's excess
over the forwards alone (per batch: capture hand-off, copies, contention with the writer's threads), and the drain
after the last forward (the writer finishing the last samples, the final commit). ``--switch-interval`` sets
Python's GIL switch interval for the whole run (a diagnostic: does the forward thread wait for the GIL?).

    python benchmarks/extract_bench.py --out /tmp/hs-extract --tokens 400000 --rounds 2

The first round pins the capture's staging memory (``cudaHostAlloc``, which also holds up the forward thread's
launches); later rounds in the process reuse it, as a long extraction does after its first minute.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time

import torch

import hsdata
from hook_overhead_bench import build_model
from hsdata.extract import engine_hf
from hsdata.extract.conversations import Record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=400_000)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval for the run, in seconds")
    parser.add_argument("--rounds", type=int, default=2, help="extractions, each against forwards alone just before")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
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
    rounds = []
    for round_ in range(args.rounds):  # the first pins its staging memory (cudaHostAlloc), later ones reuse it
        baseline = forward_only()
        shutil.rmtree(args.out, ignore_errors=True)
        marks: list[float] = []  # when the plan was made, then after each forward's hand-off to the capture
        torch.cuda.synchronize()
        started = time.perf_counter()
        summary = engine_hf.extract(model, None, records, args.out, model_name="random/llama-3-8b",
                                    max_batch_tokens=args.max_batch_tokens,
                                    on_plan=lambda *_: marks.append(time.perf_counter()),
                                    on_batch=lambda *_: marks.append(time.perf_counter()))
        seconds = time.perf_counter() - started  # ends when every sample is committed
        store = hsdata.open(args.out)
        written = store.num_tokens * store.spec.token_nbytes
        rounds.append({
            "round": round_ + 1, "ok": summary.ok, "forward_only_s": baseline, "extract_s": seconds,
            "forward_only_tokens_per_s": total / baseline, "extract_tokens_per_s": total / seconds,
            "written_gb_per_s": written / seconds / 1e9, "bytes_written": written,
            "share_outside_forward": 1 - baseline / seconds,
            # a hand-off returns once its forward has run (it copies input_ids to the GPU): the marks span the
            # forwards, what follows the last one is the drain (the writer's last samples, the final commit)
            "before_first_forward_s": marks[0] - started, "loop_excess_s": marks[-1] - marks[0] - baseline,
            "drain_s": seconds - (marks[-1] - started),
        })
        print(json.dumps(rounds[-1]), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "samples": len(records), "tokens": total,
              "switch_interval_s": sys.getswitchinterval(), "rounds": rounds}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

if __name__ == "__main__":
    main()
