"""fp8 stores: size against bf16, and the error of each fp8 choice on real states.

States, made in the run (no download): a trained model's, sentence-transformers/all-MiniLM-L6-v2 (H = 384, the
compression study's model and corpus: benchmarks/compression_bench.py), and the demo model's (``hsdata extract``'s
embedded default, H = 256, random weights), each rounded to bf16 as a store holds them. For each:

  e4m3 per token    hsdata's float8_e4m3fn: a float32 scale per token and layer (hsdata.codecs.quantize)
  e5m2 per token    the same with float8_e5m2
  e4m3 per tensor   one scale per sample and layer: max |x| over the sample's tokens / 448
  e5m2 per tensor   the same with e5m2

Per token and layer slice against the bf16 states: relative L2 error ||q - x|| / ||x|| (median, p99, worst),
cosine similarity (median, worst), and the largest absolute error relative to the tensor's largest magnitude.
Sizes: hsdata stores of the same samples on disk (payload and files), bf16 and e4m3, each uncompressed and with
``compression="zstd"``.

    python benchmarks/fp8_bench.py --dir /tmp/hsbench-fp8 --json benchmarks/results/fp8_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

import hsdata
from hsdata.codecs import quantize
from hsdata.dtypes import DTYPES

SAMPLE_TOKENS = 1024  # the trained model's states cut into samples of this many tokens (4 sequences)
CHOICES = {"e4m3 per token": ("float8_e4m3fn", "token"), "e5m2 per token": ("float8_e5m2", "token"),
           "e4m3 per tensor": ("float8_e4m3fn", "tensor"), "e5m2 per tensor": ("float8_e5m2", "tensor")}


def trained_states(tokens: int) -> tuple[list[dict], int]:
    """The trained MiniLM's states of ``tokens`` corpus tokens, bf16, as samples of SAMPLE_TOKENS."""
    sys.path.insert(0, os.path.dirname(__file__))
    from compression_bench import corpus, hidden_states, model_dir
    from transformers import AutoModel, AutoTokenizer

    path = model_dir()
    ids, _ = corpus(AutoTokenizer.from_pretrained(path), tokens, 0)
    states = hidden_states(AutoModel.from_pretrained(path).eval(), ids)
    flat = ids.flatten()
    samples = []
    for start in range(0, len(flat), SAMPLE_TOKENS):
        end = start + SAMPLE_TOKENS
        samples.append({"input_ids": flat[start:end], "loss_mask": torch.ones(end - start, dtype=torch.uint8),
                        "aux_hidden_states": states["aux_hidden_states"][start:end].bfloat16(),
                        "hidden_states": states["hidden_states"][start:end].bfloat16()})
    return samples, states["hidden_states"].shape[1]


def demo_states(work: str) -> tuple[list[dict], int]:
    path = os.path.join(work, "demo")
    subprocess.run([sys.executable, "-m", "hsdata", "extract", "--out", path], check=True, capture_output=True)
    store = hsdata.open(path)
    return [{k: v for k, v in store[i].items() if k != "sample_id"} for i in range(len(store))], store.spec.hidden_size


def per_tensor(states: torch.Tensor, layers: int, dtype: str) -> torch.Tensor:
    """One scale per sample and layer (float32), then the same rounding as hsdata's; back to bf16."""
    top = DTYPES[dtype].fp8_max
    x = states.float().reshape(len(states), layers, -1)
    scale = x.abs().amax(dim=(0, 2), keepdim=True) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / scale).clamp(-top, top).to(DTYPES[dtype].torch).float() * scale
    return q.reshape(states.shape).bfloat16()


def roundtrip(states: torch.Tensor, layers: int, dtype: str, scaling: str) -> torch.Tensor:
    if scaling == "tensor":
        return per_tensor(states, layers, dtype)
    hidden = states.shape[1] // layers
    return quantize.dequantize(quantize.quantize(states, layers, dtype), layers, hidden, dtype)


def errors(samples: list[dict], layers: dict[str, int]) -> list[dict]:
    rows = []
    for name, (dtype, scaling) in CHOICES.items():
        for tensor, k in layers.items():
            rel, cos, worst_abs = [], [], 0.0
            for s in samples:
                x = s[tensor].float()
                q = roundtrip(s[tensor], k, dtype, scaling).float()
                xs, qs = x.reshape(len(x) * k, -1), q.reshape(len(x) * k, -1)
                norm = xs.norm(dim=1)
                keep = norm > 0
                rel.append(((qs - xs).norm(dim=1)[keep] / norm[keep]))
                cos.append(torch.nn.functional.cosine_similarity(qs[keep], xs[keep], dim=1))
                worst_abs = max(worst_abs, float((q - x).abs().max() / x.abs().max()))
            rel_all, cos_all = torch.cat(rel).double().numpy(), torch.cat(cos).double().numpy()
            rows.append({"choice": name, "tensor": tensor, "rel_l2_median": float(np.median(rel_all)),
                         "rel_l2_p99": float(np.percentile(rel_all, 99)), "rel_l2_worst": float(rel_all.max()),
                         "cosine_median": float(np.median(cos_all)), "cosine_worst": float(cos_all.min()),
                         "max_abs_over_max": worst_abs, "slices": int(len(rel_all))})
    return rows


def sizes(work: str, samples: list[dict], hidden: int) -> list[dict]:
    rows = []
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for compression in (None, "zstd"):
            path = os.path.join(work, f"store-{dtype}-{compression}")
            shutil.rmtree(path, ignore_errors=True)
            with hsdata.create(path, hidden_size=hidden, aux_layers=[0, 2, 3], dtype=dtype,
                               compression=compression) as w:
                for i, s in enumerate(samples):
                    w.add(f"s{i:05d}", **s)
            store = hsdata.open(path)
            parts = os.path.join(path, "parts")
            hidden_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(parts) for f in fs
                               if "hidden_states" in d)
            rows.append({"dtype": dtype, "compression": compression or "none",
                         "payload_bytes": store.num_tokens * store.spec.token_nbytes,
                         "hidden_state_file_bytes": hidden_bytes})
    base = rows[0]["hidden_state_file_bytes"]
    for row in rows:
        row["x_bf16"] = row["hidden_state_file_bytes"] / base
    return rows


def markdown(result: dict) -> str:
    lines = []
    for model, part in result["models"].items():
        lines += [f"**{model}** ({part['samples']} samples, {part['tokens']:,} tokens, H = {part['hidden']})", "",
                  "| choice | tensor | rel. L2 median | p99 | worst | cosine median | worst | max abs / max |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in part["errors"]:
            lines.append(f"| {r['choice']} | {r['tensor']} | {r['rel_l2_median']:.4f} | {r['rel_l2_p99']:.4f} | "
                         f"{r['rel_l2_worst']:.4f} | {r['cosine_median']:.6f} | {r['cosine_worst']:.6f} | "
                         f"{r['max_abs_over_max']:.4f} |")
        lines += ["", "| stored | compression | hidden-state files | x bf16 |", "|---|---|---:|---:|"]
        for r in part["sizes"]:
            lines.append(f"| {r['dtype']} | {r['compression']} | {r['hidden_state_file_bytes']:,} | {r['x_bf16']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--tokens", type=int, default=65_536, help="the trained model's tokens (65,536)")
    parser.add_argument("--json")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    result = {"models": {}}
    for model, (samples, hidden) in {"all-MiniLM-L6-v2 (trained)": trained_states(args.tokens),
                                     "demo model (random weights)": demo_states(args.dir)}.items():
        layers = {"aux_hidden_states": samples[0]["aux_hidden_states"].shape[1] // hidden, "hidden_states": 1}
        result["models"][model] = {"samples": len(samples), "tokens": sum(len(s["input_ids"]) for s in samples),
                                   "hidden": hidden, "errors": errors(samples, layers),
                                   "sizes": sizes(os.path.join(args.dir, model.split()[0]), samples, hidden)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(markdown(result))


if __name__ == "__main__":
    main()
