"""The drafter trained from an fp8 store against the same run from the bf16 store it was converted from.

The demo model's states (``hsdata extract``'s embedded default: 24 conversations, H = 256, bf16) are stored bf16
and converted with ``hsdata convert --dtype float8_e4m3fn``. SpecForge 0.2.0's own trainer (the path of
tests/test_specforge.py: ``build_disagg_offline_runtime`` fed by ``hsdata.integrations.specforge``, on the CPU)
trains a one-layer EAGLE-3 drafter against the demo model's own ``lm_head``, the same steps with the same seed,
once from each store, and once more from the bf16 store with another seed (how far a seed alone moves the
figures: the noise the fp8 difference is read against). ``--target-steps N`` first trains the demo model N steps
on its conversations, so the target's next tokens are confident as a trained LLM's are, and extracts from that.
Reported per run: the loss and SpecForge's accuracies (the drafter's top-1 agreement with the target's next
token, per TTT position) at every step, and their means over the last ``--tail`` steps.

``--seeds N`` trains N pairs instead (bf16 and fp8, seeds 0 .. N-1; a seed orders the data) and evaluates every
trained drafter the way it is used, on the target's own bf16 states: SpecForge's step over every sample of the
bf16 store, without training, counting the drafter's top-1 agreements with the target per TTT position. Each
pair's difference (fp8 - bf16) is then read against the spread between seeds: the mean difference with its 95%
interval (Student's t over the pairs).

    python benchmarks/fp8_drafter_bench.py --dir /tmp/hsbench-drafter --steps 96 --tail 12 --target-steps 150 --json benchmarks/results/fp8_drafter_bench_trained.json
    python benchmarks/fp8_drafter_bench.py --dir /tmp/hsbench-drafter-seeds --steps 96 --target-steps 150 --seeds 6 --json benchmarks/results/fp8_drafter_bench_seeds.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

import hsdata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"bf16": ("bf16", 0), "fp8": ("fp8", 0), "bf16, seed 1": ("bf16", 1)}  # run: (store, seed)
T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
         20: 2.09, 30: 2.04}  # Student's t, two-sided 95%, by degrees of freedom


def runs_of(seeds: int) -> dict[str, tuple[str, int]]:
    """The runs: the three above, or with ``seeds`` a bf16 and an fp8 run for each seed."""
    if not seeds:
        return RUNS
    return {f"{store}, seed {seed}": (store, seed) for seed in range(seeds) for store in ("bf16", "fp8")}


def draft_config(hidden: int, vocab: int) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": vocab,
            "draft_vocab_size": vocab, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def trained_target(work: str, steps: int) -> tuple[str, float]:
    """The demo model trained (fp32, AdamW, seed 0) on its own conversations for ``steps`` full-batch steps of
    next-token loss, saved with its tokenizer as a local model folder: a target whose next-token distribution is
    peaked, as a trained LLM's is (the random-weight demo model's logits are nearly tied, so its top-1 flips
    under any rounding of the final state)."""
    from hsdata.extract import demo
    from hsdata.extract.conversations import read_jsonl

    tokenizer = demo.tokenizer()
    texts = [tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in r.messages],
                                           tokenize=False) for r in read_jsonl(demo.data_path())]
    tokenizer.pad_token = "<unk>"  # (the demo tokenizer has none; padding is masked out of the loss below)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model = demo.model(len(tokenizer), seed=0, dtype=torch.float32).train()
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(steps):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    folder = os.path.join(work, "target")
    model.eval().to(torch.bfloat16).save_pretrained(folder)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(folder)
    return folder, float(loss.detach())


def prepare(work: str, target_steps: int) -> dict:
    from transformers import AutoModelForCausalLM

    from hsdata.extract import demo

    bf16, fp8 = os.path.join(work, "bf16"), os.path.join(work, "fp8")
    model_args, facts = [], {"target": "the demo model, random weights"}
    if target_steps:
        folder, loss = trained_target(work, target_steps)
        model_args = ["--model", folder, "--data", demo.data_path()]
        facts["target"] = f"the demo model trained {target_steps} steps on its conversations (final loss {loss:.3f})"
    subprocess.run([sys.executable, "-m", "hsdata", "extract", "--out", bf16, *model_args], check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "-m", "hsdata", "convert", bf16, fp8, "--dtype", "float8_e4m3fn"], check=True,
                   capture_output=True)
    spec = hsdata.open(bf16).spec
    if target_steps:
        head = AutoModelForCausalLM.from_pretrained(folder).lm_head.weight.detach().float()
    else:
        head = demo.model(spec.vocab_size, seed=0).lm_head.weight.detach().float()  # the extract's own model
    torch.save(head, os.path.join(work, "lm_head.pt"))
    return {**facts, "hidden": spec.hidden_size, "vocab": spec.vocab_size, "samples": len(hsdata.open(bf16)),
            "max_length": int(hsdata.open(bf16).lengths.max())}


def train(work: str, steps: int, seeds: int) -> None:
    """In the subprocess: SpecForge's trainer from each store, in a fresh folder each (same seeds); with
    ``seeds``, each trained drafter evaluated on the bf16 store too."""
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_specforge import BATCH, _train

    facts = json.load(open(os.path.join(work, "facts.json")))
    config = draft_config(facts["hidden"], facts["vocab"])
    weight = torch.load(os.path.join(work, "lm_head.pt"))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("gloo", init_method=f"file://{work}/process-group", rank=0, world_size=1)
    try:
        runs, evaluated = {}, {}
        for name, (store, seed) in runs_of(seeds).items():
            folder = os.path.join(work, f"train-{store}-seed{seed}")
            os.makedirs(folder)
            epochs = -(-steps * BATCH // facts["samples"])
            trained = _train(folder, store, os.path.join(work, store), steps=steps, epochs=epochs,
                             max_len=facts["max_length"], seed=seed, config=config, target_weight=weight)
            runs[name] = trained["metrics"]
            if seeds:
                evaluated[name] = evaluate(folder, trained["weights"], os.path.join(work, "bf16"), facts["max_length"])
                print(name, evaluated[name], flush=True)
    finally:
        dist.destroy_process_group()
    torch.save({"runs": runs, "evaluated": evaluated}, os.path.join(work, "runs.pt"))


def evaluate(folder: str, weights: dict, store: str, max_len: int) -> dict:
    """A trained drafter's top-1 agreement with the target on every sample of ``store`` (SpecForge's step, no
    training): agreements and positions counted per TTT position."""
    from specforge.algorithms.eagle3.providers import build_step
    from specforge.runtime.contracts import TrainBatch
    from test_specforge import BATCH, _build_models

    from hsdata.torch import Eagle3Dataset, collate_eagle3

    model, head = _build_models(folder)
    own = {k.removeprefix("draft_model."): v for k, v in weights.items()}
    missing, unexpected = model.draft_model.load_state_dict(own, strict=False)
    if unexpected or any("embed" not in k for k in missing):  # the embedding is frozen, kept out of checkpoints
        raise RuntimeError(f"the trained weights do not fit the drafter: missing {missing}, unexpected {unexpected}")
    step = build_step(model.eval(), target_head=head)
    dataset = Eagle3Dataset(store, max_length=max_len)
    corrects, denoms = None, None
    with torch.no_grad():
        for first in range(0, len(dataset), BATCH):
            positions = list(range(first, min(first + BATCH, len(dataset))))
            tensors = collate_eagle3([dataset[i] for i in positions], convention="specforge")
            batch = TrainBatch(sample_ids=[str(i) for i in positions], strategy="eagle3", tensors=tensors,
                               metadata={"target_repr": "hidden_state"})
            metrics = step.forward_loss(batch).metrics
            got = [float(c) for c in metrics["acc_corrects"]], [float(d) for d in metrics["acc_denoms"]]
            corrects = got[0] if corrects is None else [a + b for a, b in zip(corrects, got[0])]
            denoms = got[1] if denoms is None else [a + b for a, b in zip(denoms, got[1])]
    return {"agreement": [c / d for c, d in zip(corrects, denoms)], "positions": denoms,
            "mean_agreement": sum(corrects) / sum(denoms)}


def paired(evaluated: dict, seeds: int) -> dict:
    """Per seed, fp8's evaluated agreement less bf16's (absolute and relative to bf16's), and their mean with a
    95% interval over the seeds; beside it, how far bf16's own agreement spreads from seed to seed."""
    def agreement(store: str, seed: int) -> float:
        return evaluated[f"{store}, seed {seed}"]["mean_agreement"]

    bf16 = [agreement("bf16", k) for k in range(seeds)]
    diffs = [agreement("fp8", k) - b for k, b in enumerate(bf16)]
    mean_bf16 = sum(bf16) / seeds
    out = {"bf16": bf16, "fp8": [agreement("fp8", k) for k in range(seeds)], "differences": diffs,
           "mean_bf16": mean_bf16, "mean_difference": sum(diffs) / seeds}
    if mean_bf16 == 0:  # (no agreement at all: nothing to be relative to)
        return out
    out["relative_mean_difference"] = out["mean_difference"] / mean_bf16
    if seeds > 1:
        def spread(values: list[float]) -> float:
            mean = sum(values) / len(values)
            return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5

        t = T_975[max(k for k in T_975 if k <= seeds - 1)]
        half = t * spread(diffs) / seeds ** 0.5
        out.update({"interval_95": [out["mean_difference"] - half, out["mean_difference"] + half],
                    "relative_interval_95": [(out["mean_difference"] - half) / mean_bf16,
                                             (out["mean_difference"] + half) / mean_bf16],
                    "seed_spread_bf16": spread(bf16), "relative_seed_spread_bf16": spread(bf16) / mean_bf16})
    return out


def summary(runs: dict, tail: int) -> dict:
    out = {}
    for name, metrics in runs.items():
        keys = sorted({k for _, m in metrics for k in m if isinstance(m[k], (int, float))})
        last = metrics[-tail:]
        out[name] = {"steps": len(metrics), "final": metrics[-1][1],
                     "tail_mean": {k: sum(m[k] for _, m in last) / len(last) for k in keys}}
    if "bf16" not in out:  # (--seeds: compared by evaluation, paired)
        return out
    base = out["bf16"]["tail_mean"]
    for name, key in (("fp8", "fp8_vs_bf16_relative"), ("bf16, seed 1", "seed_1_vs_seed_0_relative")):
        other = out[name]["tail_mean"]  # the second: what another seed alone moves (the comparison's noise)
        out[key] = {k: (other[k] - base[k]) / abs(base[k]) for k in base if base[k]}
    return out


def per_step(metrics: dict, seeds: int) -> dict:
    """A step's metrics as saved: all of them, or with ``seeds`` (12 runs or more, compared by evaluation) the
    loss and the agreement only, to 5 decimals."""
    if not seeds:
        return metrics
    return {k: round(metrics[k], 5) for k in ("loss", "acc") if k in metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--tail", type=int, default=12, help="steps averaged at the end (one epoch: 12)")
    parser.add_argument("--target-steps", type=int, default=0,
                        help="train the demo target this many steps on its conversations first (0: random weights)")
    parser.add_argument("--seeds", type=int, default=0,
                        help="train this many bf16 / fp8 pairs (seeds 0 ..) and compare them evaluated on bf16 states")
    parser.add_argument("--json")
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # the subprocess
    args = parser.parse_args()
    if args.target_steps < 0 or args.steps < 1 or args.tail < 1 or args.seeds < 0:
        parser.error("--target-steps and --seeds must be >= 0, --steps and --tail >= 1")
    if args.train:
        train(args.dir, args.steps, args.seeds)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    facts = prepare(args.dir, args.target_steps)
    json.dump(facts, open(os.path.join(args.dir, "facts.json"), "w"))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_specforge import TRAINING_ENV

    subprocess.run([sys.executable, __file__, "--dir", args.dir, "--steps", str(args.steps), "--seeds",
                    str(args.seeds), "--train"], check=True, env={**os.environ, **TRAINING_ENV})
    saved = torch.load(os.path.join(args.dir, "runs.pt"), weights_only=False)
    runs = saved["runs"]
    result = {"facts": facts, "steps": args.steps, "tail": args.tail, **summary(runs, args.tail),
              "per_step": {name: [(s, per_step(m, args.seeds)) for s, m in metrics] for name, metrics in runs.items()}}
    if args.seeds:
        result["evaluated"] = saved["evaluated"]
        result["paired"] = paired(saved["evaluated"], args.seeds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    for name in runs_of(args.seeds):
        print(name, json.dumps({k: round(v, 4) for k, v in result[name]["tail_mean"].items()}))
    for key in ("fp8_vs_bf16_relative", "seed_1_vs_seed_0_relative", "paired"):
        if key in result:
            print(key, json.dumps(result[key] if key == "paired" else {k: round(v, 4) for k, v in
                                                                         result[key].items()}))



if __name__ == "__main__":
    main()
