"""MagicPIG (Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation", ICLR 2025): the method and its
calibrated variant (:mod:`.magicpig`) and its SimHash bucket tables (:mod:`.lsh`, Sec. 4)."""
from .lsh import BucketTables, build_tables, lookup, simhash
from .magicpig import (OFFICIAL_DENSE_LAYERS, MagicPIG, MagicPIGCalibrated, PigState, SampledFetched,
                       collision_probability, importance_log_weight, inclusion_probability, merge_attention,
                       partial_attention)

__all__ = ["BucketTables", "build_tables", "lookup", "simhash", "OFFICIAL_DENSE_LAYERS", "MagicPIG",
           "MagicPIGCalibrated", "PigState", "SampledFetched", "collision_probability", "importance_log_weight",
           "inclusion_probability", "merge_attention", "partial_attention"]
