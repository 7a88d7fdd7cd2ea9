"""Stand-in for ``vllm._custom_ops`` so that SGLang 0.5.23 starts on its generic (CPU) platform.

``sglang/srt/layers/rotary_embedding/base.py`` imports ``vllm._custom_ops.rotary_embedding`` in
``RotaryEmbedding.__init__`` on any platform that is not CUDA, the CPU engine, XPU, NPU, MUSA, MPS or out-of-tree,
although it then dispatches to ``forward_native`` and never calls it. vllm itself cannot be installed here (it
needs a GPU build of torch), so the end-to-end tests put this folder on the server's ``PYTHONPATH``.
"""


def rotary_embedding(*args, **kwargs):
    raise RuntimeError("vllm stand-in: rotary_embedding must not be called on SGLang's generic platform")
