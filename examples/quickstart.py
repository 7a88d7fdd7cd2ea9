"""Write a small store of random hidden states, read it back, and check it bit for bit.

    python examples/quickstart.py demo-store
"""

import sys

import torch

import hsdata

path = sys.argv[1] if len(sys.argv) > 1 else "demo-store"
hidden, aux_layers = 256, [1, 13, 28]  # "output of layer k" ids, as for a 32-layer model
samples = {}
with hsdata.create(path, hidden_size=hidden, aux_layers=aux_layers, model="demo/random") as writer:
    for i in range(64):
        if f"demo-{i:04d}" in writer:  # already committed by an earlier run: resume
            continue
        n = int(torch.randint(16, 512, ()))
        samples[f"demo-{i:04d}"] = sample = {
            "input_ids": torch.randint(0, 32000, (n,)),
            "loss_mask": (torch.arange(n) > n // 3).to(torch.uint8),
            "aux_hidden_states": torch.randn(n, len(aux_layers) * hidden).to(torch.bfloat16),
            "hidden_states": torch.randn(n, hidden).to(torch.bfloat16),
        }
        writer.add(f"demo-{i:04d}", **sample)



def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if want.dtype == torch.bfloat16:  # compare bit patterns: NaN == NaN
        return torch.equal(got.view(torch.int16), want.view(torch.int16))
    return torch.equal(got, want.to(got.dtype))


store = hsdata.open(path)
for sample_id, sample in samples.items():
    got = store.get(sample_id)
    assert all(same(got[name], value) for name, value in sample.items()), sample_id
print(f"{path}: {len(store)} samples, {store.num_tokens} tokens; {len(samples)} written now and read back bit-exact")
