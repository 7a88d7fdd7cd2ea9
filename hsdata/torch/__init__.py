"""PyTorch training side: EAGLE-3 datasets over stores (with read-ahead, selections and held-out splits), mixtures
of stores, shard-aware samplers with exact mid-epoch resume (per sample, or length-grouped batches under a token
budget; ``torchdata``'s ``StatefulDataLoader`` saves and restores them), collate functions that pad (in hsdata's,
SpecForge's or ModelOpt's batch layout) or pack, and ``Loader``, which reads batches straight into their place
(on threads or in worker processes, in recycled pinned memory) and moves them to the GPU ahead of the step.
docs/training.md shows each."""

from .collate import collate_eagle3, pack_eagle3
from .dataset import Eagle3Dataset
from .device import to_device
from .loader import Loader
from .mixture import Mixture
from .samplers import ShardAwareSampler, TokenBudgetBatchSampler

__all__ = ["Eagle3Dataset", "Loader", "Mixture", "ShardAwareSampler", "TokenBudgetBatchSampler", "collate_eagle3",
           "pack_eagle3", "to_device"]
