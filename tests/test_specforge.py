"""hsdata.integrations.specforge against the real SpecForge (0.2.0, installed with --no-deps): the features a
store hands SpecForge's trainer are those SpecForge reads from the same samples' ``.ckpt`` files, and SpecForge's
own trainer fed from the store trains exactly as it does from the ``.ckpt`` files (losses, gradients, weights).

The training runs in a subprocess (``python tests/test_specforge.py WORKDIR``): SpecForge's Triton loss runs on the
CPU only with ``TRITON_INTERPRET=1``, read when the kernels are defined, and the trainer needs a process group;
neither should leak into the rest of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import hsdata

pytest.importorskip("specforge.runtime.data_plane.feature_store",
                    reason="SpecForge is not installed in this interpreter: pip install --no-deps specforge==0.2.0 "
                           "'.[specforge]'")
from specforge.runtime.data_plane.feature_store import LocalFeatureStore, spec_from_tensor
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

from hsdata.integrations.specforge import HsdataFeatureStore

H, V, DRAFT_V = 64, 256, 64  # target hidden size, target vocab, draft vocab
AUX_LAYERS = [1, 3, 4]
LENGTHS = [12, 20, 16, 9]  # 20 > MAX_LEN: truncated by SpecForge's normalizer, on both sides
MAX_LEN, TTT, BATCH, STEPS = 16, 3, 2, 2
TRAINING_ENV = {"TRITON_INTERPRET": "1", "SPECFORGE_DEVICE": "cpu", "FSDP_SHARDING": "NO_SHARD",
                # SpecForge's loss and draft layers are wrapped in torch.compile; on a CPU inductor compiles C++
                # for minutes. Eager runs the same operations, on both sides.
                "TORCHDYNAMO_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def make_samples(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Samples as SpecForge's offline capture saves them (bf16 target)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in LENGTHS:
        loss_mask = torch.ones(n, dtype=torch.int64)
        loss_mask[: n // 3] = 0  # the prompt
        samples.append({
            "input_ids": torch.randint(0, V, (n,), generator=g),
            "loss_mask": loss_mask,
            "hidden_state": torch.randn(1, n, H, generator=g).to(torch.bfloat16),
            "aux_hidden_state": torch.randn(1, n, len(AUX_LAYERS) * H, generator=g).to(torch.bfloat16),
        })
    return samples


def write_ckpts(root: str, samples) -> str:
    """SpecForge's layout: ``rows_{g}-{g+2000}/data_{idx}.ckpt``, one ``torch.save`` dict per sample."""
    os.makedirs(os.path.join(root, "rows_0-2000"))
    for i, sample in enumerate(samples):
        torch.save(sample, os.path.join(root, "rows_0-2000", f"data_{i}.ckpt"))
    return root


def write_store(path: str, samples, *, loss_masks: bool = True) -> str:
    with hsdata.create(path, hidden_size=H, aux_layers=AUX_LAYERS, model="tiny-llama", dtype="bfloat16") as writer:
        for i, s in enumerate(samples):
            writer.add(f"sample-{i}", input_ids=s["input_ids"], loss_mask=s["loss_mask"] if loss_masks else None,
                       aux_hidden_states=s["aux_hidden_state"][0], hidden_states=s["hidden_state"][0])
    return path


@pytest.fixture
def data(tmp_path):
    samples = make_samples()
    return samples, write_ckpts(str(tmp_path / "ckpt"), samples), write_store(str(tmp_path / "store"), samples)


def test_features_are_the_ones_specforge_reads_from_ckpt(data):
    samples, ckpt, store = data
    ckpt_refs = OfflineManifestReader(ckpt, ttt_length=TTT, max_len=MAX_LEN).read()
    local = LocalFeatureStore("ckpt")
    features = HsdataFeatureStore(store)
    assert features.store.verify
    refs = features.refs(run_id="run", ttt_length=TTT, max_len=MAX_LEN)
    assert [r.sample_id for r in refs] == [f"sample-{i}" for i in range(len(samples))]
    for ref, ckpt_ref in zip(refs, ckpt_refs):
        assert ref.metadata["target_repr"] == ckpt_ref.metadata["target_repr"] == "hidden_state"
        assert (ref.metadata["ttt_length"], ref.metadata["max_len"]) == (TTT, MAX_LEN)
        assert (ref.strategy, ref.schema_version, set(ref.feature_keys)) == \
            (ckpt_ref.strategy, ckpt_ref.schema_version, set(ckpt_ref.feature_keys))
        got, handle = features.get(ref)
        want, _ = local.get(ckpt_ref)
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
            assert ref.feature_specs[key] == spec_from_tensor(key, value)  # from the manifest, nothing read
        assert ref.num_tokens == len(want["input_ids"])
        assert ref.estimated_bytes == sum(v.numel() * v.element_size() for v in want.values())
        features.release(handle)
    part, _ = features.get(refs[1], names=["input_ids"])
    assert list(part) == ["input_ids"] and torch.equal(part["input_ids"], samples[1]["input_ids"])
    assert [r.sample_id for r in features.refs(["sample-3", "sample-0"])] == ["sample-3", "sample-0"]


def test_read_only_and_clear_errors(tmp_path):
    samples = make_samples()
    features = HsdataFeatureStore(write_store(str(tmp_path / "nomask"), samples[:1], loss_masks=False))
    (ref,) = features.refs()
    with pytest.raises(ValueError, match="'sample-0' has no loss mask"):
        features.get(ref)
    with pytest.raises(KeyError, match="no features"):
        features.get(ref, names=["target"])
    with pytest.raises(KeyError, match="nope"):
        features.refs(["nope"])
    with pytest.raises(TypeError, match="read-only"):
        features.put({"input_ids": samples[0]["input_ids"]}, sample_id="x", metadata={})
    assert features.health()["release_pending"] == 0


def test_specforge_trainer_from_store_equals_from_ckpt(tmp_path):
    """SpecForge's trainer, two optimizer steps of two samples each: from the ``.ckpt`` files
    (``build_offline_runtime``), from the store (``build_disagg_offline_runtime`` with the feature store), and from
    a store with one token's aux hidden state changed (which must change the training)."""
    samples = make_samples()
    write_ckpts(str(tmp_path / "ckpt"), samples)
    write_store(str(tmp_path / "store"), samples)
    perturbed = [dict(s) for s in samples]
    aux = samples[2]["aux_hidden_state"].clone()
    aux[0, 5] += 1.0  # the first token the loss counts (the prompt is the first 5): every later one attends to it
    perturbed[2]["aux_hidden_state"] = aux
    write_store(str(tmp_path / "perturbed"), perturbed)
    env = {**os.environ, **TRAINING_ENV}
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    runs = torch.load(tmp_path / "runs.pt", weights_only=False)
    ckpt, store, changed = runs["ckpt"], runs["store"], runs["perturbed"]

    assert [step for step, _ in ckpt["metrics"]] == list(range(1, STEPS + 1))
    assert ckpt["metrics"] == store["metrics"]  # loss, per-position losses, accuracies, grad norm: all of them
    assert all(m["loss"] > 0 for _, m in ckpt["metrics"])
    assert len(ckpt["grads"]) == STEPS and ckpt["grads"][0]
    for ckpt_grads, store_grads in zip(ckpt["grads"], store["grads"]):
        assert ckpt_grads.keys() == store_grads.keys()
        for name in ckpt_grads:
            assert torch.equal(ckpt_grads[name], store_grads[name]), name
    assert ckpt["weights"].keys() == store["weights"].keys()
    assert not all(torch.equal(ckpt["weights"][k], ckpt["initial"][k]) for k in ckpt["weights"])  # it trained
    for name in ckpt["weights"]:
        assert torch.equal(ckpt["weights"][name], store["weights"][name]), name
    assert [m["loss"] for _, m in changed["metrics"]] != [m["loss"] for _, m in ckpt["metrics"]]
    assert not all(torch.equal(changed["weights"][k], ckpt["weights"][k]) for k in ckpt["weights"])
    # collate_eagle3(convention="specforge") makes the batch SpecForge's loader makes (docs/training.md)
    assert runs["own_loop"]["loss"] == ckpt["metrics"][0][1]["loss"]


# --- the subprocess: SpecForge's trainer on the CPU ------------------------------------------------------------

DRAFT_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": V, "draft_vocab_size": DRAFT_V, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def _write_target(path: str, weight: torch.Tensor | None = None) -> str:
    """A target model directory holding what SpecForge's ``TargetHead`` loads: config and ``lm_head.weight``
    (``weight``, default random ``[V, H]``)."""
    from safetensors.torch import save_file

    if weight is None:
        weight = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    vocab, hidden = weight.shape
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
                   "vocab_size": vocab, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 128}, f)
    save_file({"lm_head.weight": weight}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {"lm_head.weight": "model.safetensors"}}, f)
    return path


def _build_models(work: str, config: dict = DRAFT_CONFIG, target_weight: torch.Tensor | None = None):
    """The tiny EAGLE-3 drafter (one layer, sdpa, a 64-token draft vocab) and the frozen target head, seeded."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.modeling.target.target_head import TargetHead

    config_path = os.path.join(work, "draft.json")
    if not os.path.exists(config_path):
        with open(config_path, "w") as f:
            json.dump(config, f)
        _write_target(os.path.join(work, "target"), target_weight)
        g = torch.Generator().manual_seed(2)
        vocab, draft_vocab = config["vocab_size"], config["draft_vocab_size"]
        draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[draft_ids] = True
        torch.save({"t2d": t2d, "d2t": draft_ids - torch.arange(draft_vocab)}, os.path.join(work, "vocab_mapping.pt"))
    torch.manual_seed(0)
    draft = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(config_path), attention_backend="sdpa",
                                       torch_dtype=torch.bfloat16)
    draft.load_vocab_mapping(os.path.join(work, "vocab_mapping.pt"))
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft_model=draft, length=TTT, attention_backend="sdpa").to(dtype=torch.bfloat16)
    head = TargetHead.from_pretrained(os.path.join(work, "target"), lm_head_key="lm_head.weight")
    return model, head


def _train(work: str, name: str, source: str, *, steps: int = STEPS, epochs: int = 1, max_len: int = MAX_LEN,
           seed: int = 0, **models) -> dict:
    """SpecForge's trainer, ``steps`` optimizer steps (over at most ``epochs``) from ``source`` (a ``.ckpt``
    folder or a store), its config's ``seed``; ``models``: :func:`_build_models`'s options."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.launch import build_disagg_offline_runtime, build_offline_runtime
    from specforge.optimizer import BF16Optimizer

    model, head = _build_models(work, **models)
    initial = {k: v.clone() for k, v in model.draft_model.state_dict().items()}
    grads: list[dict[str, torch.Tensor]] = []
    trainable = [(n, p) for n, p in model.draft_model.named_parameters() if p.requires_grad]

    def record(param_name):
        def hook(grad):
            if not grads or param_name in grads[-1]:
                grads.append({})
            grads[-1][param_name] = grad.detach().clone()
        return hook

    for param_name, param in trainable:
        param.register_hook(record(param_name))
    metrics: list = []
    options = {
        "algorithm": builtin_algorithm_registry().resolve("eagle3"), "draft_model": model, "target_head": head,
        "optimizer_factory": lambda module: BF16Optimizer(module, lr=1e-2, warmup_ratio=0.0, total_steps=steps,
                                                          lr_scheduler="constant"),
        "run_id": name, "output_dir": os.path.join(work, f"out-{name}"), "ttt_length": TTT, "max_len": max_len,
        "batch_size": BATCH, "max_steps": steps, "num_epochs": epochs, "seed": seed, "log_interval": 1,
        "logger": lambda values, step: metrics.append(
            (step, {k: v for k, v in values.items() if not k.startswith("perf/")})),
    }
    if source.endswith("ckpt"):
        trainer = build_offline_runtime(hidden_states_path=source, **options)
    else:
        from hsdata.integrations.specforge import HsdataFeatureStore

        store = HsdataFeatureStore(source)
        trainer = build_disagg_offline_runtime(  # fetching on 2 loader threads
            feature_store=store, refs=store.refs(run_id=name, ttt_length=TTT, max_len=max_len),
            dataloader_num_workers=2, **options)
    assert trainer.fit() == steps
    weights = trainer.core.strategy.checkpoint_state_filter(trainer.backend.state_dict()["model"])
    initial = trainer.core.strategy.checkpoint_state_filter({f"draft_model.{k}": v for k, v in initial.items()})
    return {"metrics": metrics, "grads": grads, "initial": initial,
            "weights": {k: v.detach().clone() for k, v in weights.items()}}


def _own_loop(work: str) -> dict:
    """The first batch of the runs above, made by hsdata's DataLoader collate, through SpecForge's step."""
    from specforge.algorithms.eagle3.providers import build_step
    from specforge.launch import _distributed_sampler_indices
    from specforge.runtime.contracts import TrainBatch

    from hsdata.torch import Eagle3Dataset, collate_eagle3

    model, head = _build_models(work)
    dataset = Eagle3Dataset(os.path.join(work, "store"), max_length=MAX_LEN)
    first = _distributed_sampler_indices(len(dataset), dp_rank=0, dp_size=1, seed=0, epoch=0)[:BATCH]
    tensors = collate_eagle3([dataset[i] for i in first], convention="specforge")
    batch = TrainBatch(sample_ids=[f"sample-{i}" for i in first], strategy="eagle3", tensors=tensors,
                       metadata={"target_repr": "hidden_state"})
    return {"loss": build_step(model, target_head=head).forward_loss(batch).loss.item()}


def _main(work: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("gloo", init_method=f"file://{work}/process-group", rank=0, world_size=1)
    try:
        runs = {name: _train(work, name, os.path.join(work, name))
                for name in ("ckpt", "store", "perturbed")}
        runs["own_loop"] = _own_loop(work)
    finally:
        dist.destroy_process_group()
    torch.save(runs, os.path.join(work, "runs.pt"))


if __name__ == "__main__":
    _main(sys.argv[1])
