"""Page-locking host memory that hsdata allocated itself (``cudaHostRegister``), so that copies from it to a GPU
run asynchronously on the copy engine and ``Tensor.pin_memory()`` returns the tensor itself.

Only the process that registered a buffer may use it as pinned memory: a forked child sees the same pages as
ordinary memory (and must not touch CUDA at all), so callers register in the process that copies to the GPU.
torch is imported on first use: a process that reads no tensors (the command line's audits) never loads it.
"""

from __future__ import annotations

import ctypes
import mmap

REGISTER_DEFAULT = 0  # cudaHostRegisterDefault


def available() -> bool:
    """Whether this process can pin memory: a CUDA device, and not a child forked after CUDA started."""
    import torch

    return torch.cuda.is_available() and not torch.cuda._is_in_bad_fork()


def address(buffer: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(buffer)  # an export of the buffer, released when ``view`` goes
    try:
        return ctypes.addressof(view)
    finally:
        del view


def register(buffer: mmap.mmap) -> None:
    """Page-lock ``buffer`` for CUDA; raises ``RuntimeError`` naming the CUDA error if it cannot."""
    import torch

    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(address(buffer), len(buffer), REGISTER_DEFAULT))


def unregister(buffer: mmap.mmap) -> None:
    """Undo :func:`register`; before the buffer is unmapped."""
    import torch

    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address(buffer)))
