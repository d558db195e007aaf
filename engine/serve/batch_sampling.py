"""The server's rows sample with the one sampler every caller uses (engine.sampling: RowSampler,
sample_rows): one seeded uniform a row, its own CDF inverted; kept here under its old name."""
from engine.sampling import UNIFORM_BLOCK, RowSampler, sample_rows

__all__ = ["UNIFORM_BLOCK", "RowSampler", "sample_rows"]
