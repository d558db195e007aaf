"""The two attention paths behind one protocol.

Each path is a state class with `allocate(cfg, batch, max_len, device, dtype, ...)`,
`open(tokens, real) -> Span`, `attend(layer, q, k, v, span)` and `commit(span)` (declared in `base.State`), plus a
stateless full-sequence function and its plain-torch reference twin.
"""
from engine.attention.base import Span, State
from engine.attention.feature_maps import FEATURE_MAPS, get_feature_map
from engine.attention.hybrid import HybridState, saved_state_class
from engine.attention.linear import (LinearState, linear_attention,
                                     linear_attention_reference)
from engine.attention.sliding import SlidingKVState
from engine.attention.softmax import (KVState, softmax_attention,
                                      softmax_attention_reference)
from engine.attention.sparse import SparseWindowState
from engine.attention.window import WindowState
from engine.runspec import check_attention
from models.config import ATTENTION_PATHS

STATES = {"softmax": KVState, "linear": LinearState, "window": WindowState, "hybrid": HybridState}
PATHS = ATTENTION_PATHS     # hybrid: per layer softmax or linear (engine.attention.hybrid)


def check_path(name: str) -> str:
    """An attention path's name (engine.runspec.check_attention: the rule, once)."""
    return check_attention(name)


__all__ = ["Span", "State", "saved_state_class", "KVState", "SlidingKVState", "LinearState", "WindowState", "SparseWindowState", "HybridState", "STATES", "PATHS",
           "FEATURE_MAPS", "check_path", "get_feature_map", "softmax_attention", "softmax_attention_reference",
           "linear_attention", "linear_attention_reference"]
