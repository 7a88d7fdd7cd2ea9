"""``hsdata extract --engine hf`` as one rank of a job of several processes (torchrun, or Slurm through it).

The rank comes from the usual environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); a
gloo process group (``env://``) carries the few objects the ranks exchange: rank 0's list of committed samples
at the start, every rank's summary at the end. Each rank writes its own part of the store.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def from_environment() -> Rank | None:
    """This process's rank as torchrun sets it; None when the process is alone (no ``WORLD_SIZE``, or 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return None
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: launch with torchrun "
                         "(or set RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each process)")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return Rank(rank, world_size, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def start(rank: Rank, timeout_s: float) -> None:
    """Join the job's gloo process group; a collective not completed by every rank within ``timeout_s`` fails."""
    dist.init_process_group("gloo", init_method="env://", rank=rank.rank, world_size=rank.world_size,
                            timeout=timedelta(seconds=timeout_s))


def stop() -> None:
    """Leave the process group; one whose collective failed (a rank died) is left as it is: tearing down gloo
    with a broken connection can abort the process ("terminate called without an active exception")."""
    if not _broken:
        dist.destroy_process_group()


def exit_if_broken(code: int) -> int:
    """``code``, or, in a process whose collective failed (a rank died), the end of the process with ``code`` now:
    the interpreter's teardown would destroy the broken gloo group, which can abort ("terminate called without
    an active exception", exit -6 instead of ``code``)."""
    if _broken:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def from_rank0(read: Callable[[], T]) -> T:
    """``read()`` run on rank 0 and its result (or its exception, raised) on every rank."""
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            message = [("ok", read())]
        except Exception as e:  # noqa: BLE001 - every rank raises it
            message = [("error", e)]
    _together(lambda: dist.broadcast_object_list(message, src=0))
    kind, value = message[0]
    if kind == "error":
        raise value
    return value


def gather(value: T) -> list[T] | None:
    """Every rank's ``value``, in rank order, on rank 0 (None on the others)."""
    values: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    _together(lambda: dist.gather_object(value, values, dst=0))
    return values


def record_error(error: BaseException) -> None:
    """Hand ``error`` to torchrun, which then shows it as this rank's failure (call it where it is caught)."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(error)


def barrier() -> None:
    _together(dist.barrier)


_broken = False  # a collective of this process failed


def _together(collective: Callable[[], Any]) -> None:
    """Run a collective; a rank that died or did not come in time is a one-line error, not a gloo traceback."""
    global _broken
    try:
        collective()
    except RuntimeError as e:
        _broken = True
        raise ConnectionError(f"rank {dist.get_rank()}: not every rank of the job answered (one failed, or did "
                              f"not come within --rank-timeout; its own log says why): {e}") from None


def share(batches: Sequence[list], rank: int, world_size: int) -> list[list]:
    """Rank ``rank``'s share of ``batches`` (lists of ``(sample_id, token_ids)``): every batch goes, largest
    first, to the rank with the fewest padded tokens so far (ties: the lowest rank), so the shares are balanced
    by tokens, disjoint, cover every batch, and are the same on every rank that has the same ``batches``.
    Returned in their original order."""
    def padded(i: int) -> int:
        return len(batches[i]) * max(len(ids) for _, ids in batches[i])

    loads = [0] * world_size
    mine = []
    for i in sorted(range(len(batches)), key=lambda i: (-padded(i), i)):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] += padded(i)
        if owner == rank:
            mine.append(i)
    return [batches[i] for i in sorted(mine)]


def device(requested: str, rank: Rank | None) -> str:
    """The torch device of this process: ``cuda`` means ``cuda:LOCAL_RANK`` in a job (``cuda:0`` when the
    launcher lets each process see a single GPU)."""
    chosen = torch.device(requested)
    if rank is None or chosen.type != "cuda":
        return requested
    if chosen.index is not None:
        raise ValueError(f"--device {requested}: in a job of {rank.world_size} ranks each rank takes "
                         "cuda:LOCAL_RANK; give --device cuda")
    count = torch.cuda.device_count()
    if count == 1:
        return "cuda:0"
    if rank.local_rank >= count:
        raise ValueError(f"rank {rank.rank}: LOCAL_RANK {rank.local_rank} but this node has {count} CUDA device(s)")
    return f"cuda:{rank.local_rank}"


def device_map(rank: Rank | None) -> dict[str, Any]:
    """``from_pretrained`` options spreading one model over this node's GPUs (accelerate's ``device_map="auto"``);
    with several ranks on the node, each rank gets its own block of ``GPUs // LOCAL_WORLD_SIZE`` GPUs."""
    from ..errors import MissingExtraError

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device-map auto spreads the model over this node's GPUs, and CUDA is not available "
                         f"(torch {torch.__version__}); use --device cpu")
    try:
        import accelerate  # noqa: F401 - transformers needs it for device_map
    except ImportError:
        raise MissingExtraError("--device-map auto needs accelerate: pip install accelerate") from None
    ranks_here = 1 if rank is None else rank.local_world_size
    if ranks_here == 1:
        return {"device_map": "auto"}
    per_rank = count // ranks_here
    if per_rank == 0:
        raise ValueError(f"--device-map auto: {ranks_here} ranks on this node but only {count} GPU(s)")
    mine = range(rank.local_rank * per_rank, (rank.local_rank + 1) * per_rank)
    return {"device_map": "auto",
            "max_memory": {i: int(torch.cuda.get_device_properties(i).total_memory * 0.9) for i in mine}}
