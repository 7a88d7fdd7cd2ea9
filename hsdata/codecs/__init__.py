"""How a store's values are coded: lossless compression of the hidden states' chunks (``compression``: the
configurations and their encoders; ``blosc``: the blosc1 frames, written by hsdata's own zstd encoder, parsed
for other decoders and decoded), and fp8 rows with per-layer scales (``quantize``)."""
