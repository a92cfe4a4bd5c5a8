"""Leaf forward-time data: what one model forward reads, shared by models, layers, kernels and engine.

This package imports nothing of mmlora, so every layer above it may import it (see
docs/architecture.md for the layer order, checked by tests/unit/test_import_layers.py).
"""

from mmlora.forward.attention import AttentionMetadata
from mmlora.forward.batch import ForwardBatch
from mmlora.forward.lora import LoRABatchInfo, LoRAWeights, rank_bucket, rank_buckets

__all__ = ["AttentionMetadata", "ForwardBatch", "LoRABatchInfo", "LoRAWeights", "rank_bucket", "rank_buckets"]
