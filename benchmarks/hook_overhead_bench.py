"""What capturing prefill hidden states costs a real GPU forward (needs a CUDA GPU).

A transformers Llama model of Llama-3-8B shape (random bf16 weights, SDPA) prefills batches of 8 x 2048 tokens
(16K tokens) back to back, in three modes measured in the same run:
  none    no capture;
  naive   the aux layers and the final state copied with a plain ``.cpu()`` after each forward;
  hsdata  ``hsdata.extract.capture.Capture.add_forward`` (pinned staging on a side stream, a writer thread, a real store);
  hsdata fp8  the same into a ``float8_e4m3fn`` store: quantized on the GPU (the copy stream) before the copy.
Throughput is tokens per second over all forwards of a mode, synchronizing once at the end, so a side-stream copy
overlaps the next forward as it does in a server. The capture's rows are read back from the store at the end and
compared bit for bit with the GPU's.

    python benchmarks/hook_overhead_bench.py --store /dev/shm/hs-bench --forwards 24
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hsdata
from hsdata.codecs import quantize
from hsdata.extract.capture import Capture, Piece

AUX_LAYERS = [1, 15, 28]  # EAGLE-3's defaults for 32 layers, "output of layer k"


def build_model() -> torch.nn.Module:
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    return model.model.eval()  # the decoder stack and its final norm; prefill needs no full-sequence logits


def run(model, mode: str, batches: list[torch.Tensor], capture: Capture | None, keep: dict) -> float:
    captured: list[torch.Tensor] = []
    handles = []
    if mode != "none":
        for k in AUX_LAYERS:
            handles.append(model.layers[k].register_forward_hook(
                lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)))
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        for n, ids in enumerate(batches):
            captured.clear()
            final = model(input_ids=ids, use_cache=False).last_hidden_state  # post-norm
            if mode == "naive":
                torch.cat(captured, dim=-1).cpu()
                final.cpu()
            elif mode.startswith("hsdata"):
                b, t = ids.shape
                pieces = [Piece(f"f{n}-s{i}", 0, i * t, t) for i in range(b)]
                aux = [a.reshape(b * t, -1) for a in captured]
                capture.add_forward(pieces, [t] * b, ids.reshape(-1), aux, final.reshape(b * t, -1))
                if n == 0:
                    keep["aux"] = torch.cat([a[:t] for a in aux], dim=-1).clone()
                    keep["final"] = final.reshape(b * t, -1)[:t].clone()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    for h in handles:
        h.remove()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--forwards", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    args = parser.parse_args()
    model = build_model()
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 128256, (args.batch, args.seq), device="cuda", generator=g)
               for _ in range(args.forwards)]
    run(model, "none", batches[:2], None, {})  # warm-up
    tokens = args.forwards * args.batch * args.seq
    modes = ("none", "naive", "hsdata", "hsdata fp8")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    keep: dict = {}
    checked: dict = {}
    for r in range(args.rounds):
        for mode in modes:
            capture = None
            if mode.startswith("hsdata"):
                shutil.rmtree(args.store, ignore_errors=True)
                writer = hsdata.create(args.store, hidden_size=4096, aux_layers=AUX_LAYERS, model="random/llama-3-8b",
                                       dtype="float8_e4m3fn" if mode == "hsdata fp8" else "bfloat16")
                capture = Capture(writer)
            times[mode].append(run(model, mode, [b.clone() for b in batches], capture, keep))
            if capture is not None:
                drained = time.perf_counter()
                capture.close()
                times.setdefault(f"{mode}: drain after last forward", []).append(time.perf_counter() - drained)
                if mode not in checked:  # each mode's store against the GPU's states (fp8: quantized on the CPU)
                    store = hsdata.open(args.store)
                    got = store.get("f0-s0")
                    want = {"aux_hidden_states": keep["aux"].cpu(), "hidden_states": keep["final"].cpu()}
                    if mode == "hsdata fp8":
                        want = {name: quantize.dequantize(quantize.quantize(v, layers, "float8_e4m3fn"), layers,
                                                          4096, "float8_e4m3fn")
                                for (name, v), layers in zip(want.items(), (len(AUX_LAYERS), 1))}
                    checked[mode] = {"samples": len(store), "bytes": store.num_tokens * store.spec.token_nbytes,
                                     "bit_exact": all(torch.equal(got[n].view(torch.int16), w.view(torch.int16))
                                                      for n, w in want.items())}
    median = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens_per_mode": tokens,
        "stores": checked,
        "seconds": times,
        "tokens_per_s": {m: tokens / median[m] for m in modes},
        "throughput_lost": {m: 1 - median["none"] / median[m] for m in modes if m != "none"},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
