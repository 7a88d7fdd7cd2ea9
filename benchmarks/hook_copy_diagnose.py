"""Where does the staging copy's cost come from? (needs a CUDA GPU; diagnostic for hook_overhead_bench.py)

Same model and batches as ``hook_overhead_bench.py``. Each mode copies the aux layers and the final state of every
forward to pinned host memory on a side stream (nothing is written to a store) and differs in one thing only.
CUDA events on the compute stream time every forward, so the extra seconds split into "forwards ran slower"
(the copy competes with the kernels) and "gaps between forwards" (the host or a wait kept the GPU idle).

    cd benchmarks && python hook_copy_diagnose.py --modes 1 --forwards 24 --rounds 3
    cd benchmarks && python hook_copy_diagnose.py --modes 2 --forwards 24 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import warnings

import torch

from hook_overhead_bench import AUX_LAYERS, build_model


class Stager:
    """Copies tensors to pinned memory on a side stream; the variants are the constructor's switches."""

    def __init__(self, *, reuse: bool = False, priority: int = 0, chunk_rows: int = 0, same_stream: bool = False,
                 paced_rows: int = 0):
        self.reuse, self.chunk_rows, self.same_stream = reuse, chunk_rows, same_stream
        self.stream = torch.cuda.Stream(priority=priority)
        self.ring: dict[tuple, list[torch.Tensor]] = {}
        self.pending: list[torch.cuda.Event] = []
        self.paced_rows = paced_rows
        if paced_rows:
            self.queue: queue.Queue = queue.Queue(maxsize=4)
            self.thread = threading.Thread(target=self._paced_loop, daemon=True)
            self.thread.start()

    def _paced_loop(self) -> None:
        """Issue the copy one chunk at a time, at most two in flight, so other D2H copies can get in between."""
        while (item := self.queue.get()) is not None:
            ready, tensors = item
            self.stream.wait_event(ready)
            inflight: list[torch.cuda.Event] = []
            with torch.cuda.stream(self.stream):
                for t in tensors:
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    for r in range(0, t.shape[0], self.paced_rows):
                        host[r:r + self.paced_rows].copy_(t[r:r + self.paced_rows], non_blocking=True)
                        done = torch.cuda.Event(blocking=True)
                        done.record(self.stream)
                        inflight.append(done)
                        if len(inflight) > 1:
                            inflight.pop(0).synchronize()
            for done in inflight:
                done.synchronize()

    def close(self) -> None:
        if self.paced_rows:
            self.queue.put(None)
            self.thread.join()

    def _host(self, t: torch.Tensor, slot: int) -> torch.Tensor:
        if not self.reuse:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        key = (tuple(t.shape), t.dtype, slot)
        if key not in self.ring:
            self.ring[key] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for _ in range(4)]
        ring = self.ring[key]
        ring.append(ring.pop(0))
        return ring[0]

    def stage(self, tensors: list[torch.Tensor]) -> None:
        current = torch.cuda.current_stream()
        if self.paced_rows:
            ready = torch.cuda.Event()
            ready.record(current)
            self.queue.put((ready, tensors))  # the references keep the tensors alive until copied
            return
        stream = current if self.same_stream else self.stream
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for slot, t in enumerate(tensors):
                host = self._host(t, slot)
                step = self.chunk_rows or t.shape[0]
                for r in range(0, t.shape[0], step):
                    host[r:r + step].copy_(t[r:r + step], non_blocking=True)
                if stream is not current:
                    t.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        self.pending.append(done)
        if len(self.pending) > 4:  # bound like Capture's max_staged_bytes: the oldest copy must be done
            self.pending.pop(0).synchronize()


ROUND_1 = {  # the first device run: which variant of the copy costs what
    "side stream, new pinned buffers (as Capture)": {},
    "side stream, reused pinned ring": {"reuse": True},
    "side stream, high priority": {"priority": -1},
    "side stream, 16 MiB chunks": {"chunk_rows": 2048},
    "side stream, per layer during the forward": {"per_layer": True},
    "final state only (1/4 of the bytes)": {"final_only": True},
    "same stream (serial copy: its full cost)": {"same_stream": True},
}
ROUND_2 = {  # the second: copies paced from a thread, a chunk at a time
    "side stream, new pinned buffers (as Capture)": {},
    "paced from a thread, 32 MiB chunks": {"paced_rows": 4096},
    "paced from a thread, 8 MiB chunks": {"paced_rows": 1024},
    "final state only, paced 32 MiB chunks": {"final_only": True, "paced_rows": 4096},
}


def run(model, batches, mode: dict | None) -> dict:
    mode = dict(mode) if mode is not None else None
    per_layer = bool(mode and mode.pop("per_layer", False))
    final_only = bool(mode and mode.pop("final_only", False))
    stager = Stager(**mode) if mode is not None else None
    captured: list[torch.Tensor] = []
    handles = []
    if stager is not None and not final_only:
        def on_layer(_m, _a, out):
            hidden = out[0] if isinstance(out, tuple) else out
            if per_layer:
                stager.stage([hidden.reshape(-1, hidden.shape[-1])])
            else:
                captured.append(hidden)
        handles = [model.layers[k].register_forward_hook(on_layer) for k in AUX_LAYERS]
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in batches]
    torch.cuda.synchronize()
    with torch.inference_mode():
        for (start, end), ids in zip(events, batches):
            captured.clear()
            start.record()
            final = model(input_ids=ids, use_cache=False).last_hidden_state
            end.record()
            if stager is not None:
                rows = ids.numel()
                stager.stage([a.reshape(rows, -1) for a in captured] + [final.reshape(rows, -1)])
    torch.cuda.synchronize()
    if stager is not None:
        stager.close()
    for h in handles:
        h.remove()
    forwards = [s.elapsed_time(e) / 1e3 for s, e in events]
    total = events[0][0].elapsed_time(events[-1][1]) / 1e3
    return {"total_s": total, "forwards_s": sum(forwards), "gaps_s": total - sum(forwards)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forwards", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", choices=("1", "2"), default="2", help="which set of variants (ROUND_1, ROUND_2)")
    args = parser.parse_args()
    modes = {"none": None, **(ROUND_1 if args.modes == "1" else ROUND_2)}
    model = build_model()
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 128256, (args.batch, args.seq), device="cuda", generator=g)
               for _ in range(args.forwards)]
    run(model, batches[:2], None)
    run(model, batches[:6], {})  # warm the pinned-memory cache
    with warnings.catch_warnings(record=True) as syncs, torch.inference_mode():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        model(input_ids=batches[0], use_cache=False)
        torch.cuda.set_sync_debug_mode("default")
    results: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, mode in modes.items():
            results[name].append(run(model, batches, mode))
    summary = {}
    base = sorted(r["total_s"] for r in results["none"])[args.rounds // 2]
    for name, runs in results.items():
        mid = sorted(runs, key=lambda r: r["total_s"])[args.rounds // 2]
        summary[name] = {**{k: round(v, 4) for k, v in mid.items()}, "lost": round(1 - base / mid["total_s"], 4)}
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "synchronizing_ops_in_one_forward": sorted({str(w.message)[:200] for w in syncs}),
                      "median": summary, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
