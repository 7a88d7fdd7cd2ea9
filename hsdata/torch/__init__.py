"""PyTorch training side: EAGLE-3 datasets over stores (with read-ahead, selections and held-out splits), mixtures
of stores, shard-aware samplers with exact mid-epoch resume (per sample, or length-grouped batches under a token
budget; ``torchdata``'s ``StatefulDataLoader`` saves and restores them), and collate functions that pad (in
hsdata's, SpecForge's or ModelOpt's batch layout) or pack. docs/training.md shows each."""

from .collate import collate_eagle3, pack_eagle3
from .dataset import Eagle3Dataset
from .mixture import Mixture
from .samplers import ShardAwareSampler, TokenBudgetBatchSampler

__all__ = ["Eagle3Dataset", "Mixture", "ShardAwareSampler", "TokenBudgetBatchSampler", "collate_eagle3",
           "pack_eagle3"]
