"""engine.quant: blocks byte-for-byte as llama.cpp's reference quantizers (gguf-py), dequantization as gguf-py's."""
import numpy as np
import pytest
import torch

from engine.errors import InvalidArgumentError
from engine.quant import BLOCK_BYTES, dequantize, quantize, quantize_model
from tests.conftest import tiny_model

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 96, generator=g) * 0.1
    w[0, :32] = 0.0                      # an all-zero block: d = 0
    w[1, :32] = 0.25                     # a constant block
    w[2, 5] = -3.0                       # an outlier
    return w


@pytest.mark.parametrize("kind", list(QTYPE))
def test_blocks_equal_gguf_reference(kind):
    w = weights()
    ours = quantize(w, kind)
    ref = quants.quantize(w.numpy(), QTYPE[kind])
    assert ours.shape == (48, 96 // 32 * BLOCK_BYTES[kind])
    assert np.array_equal(ours.numpy(), ref), "blocks differ from llama.cpp's reference quantizer"
    back = dequantize(ours, kind, w.shape)
    assert np.array_equal(back.numpy(), quants.dequantize(ref, QTYPE[kind]).astype(np.float32))
    step = (w.reshape(48, 3, 32).abs().amax(-1) * (2 / 127 if kind == "q8_0" else 2 / 15)).max().item()
    assert (back - w).abs().max().item() <= step


def test_quantize_model_keeps_widths_it_cannot_block():
    model = tiny_model(intermediate_size=40)          # down_proj has 40 inputs: not a multiple of 32
    kept = quantize_model(model, "q8_0")
    assert kept == [f"layers.{i}.mlp.down_proj" for i in range(2)]
    with pytest.raises(InvalidArgumentError):
        quantize_model(model, "q5_k")
