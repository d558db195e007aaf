"""The native step's float matmul (kernels.c mat_rows, tile.c's AVX-512 register tiles) against a
float64 reference, for every weight type, batch sizes 1..17 (not multiples of the 8-input tile),
row ranges that do not start at 0 or fill a 16-row block, and widths that are not multiples of 16."""
import ctypes

import pytest
import torch


TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def lib(native_built):
    from engine.steps.native import Mat
    lib = native_built
    lib.mat_rows.argtypes = [ctypes.POINTER(Mat), ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                             ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.mat_rows.restype = None
    return lib, Mat


def mat_rows(lib, w, r0, r1, x, add_to=None):
    """out (B, r1 - r0) = x (B, cols) @ w[r0:r1].T (+ add_to), through the C kernel."""
    lib, Mat = lib
    rows, cols = w.shape
    out = torch.zeros(x.shape[0], r1 - r0) if add_to is None else add_to.clone()
    m = Mat(w.data_ptr(), TYPES[w.dtype], rows, cols)
    lib.mat_rows(ctypes.byref(m), r0, r1, x.data_ptr(), cols, x.shape[0], out.data_ptr(), r1 - r0,
                 int(add_to is not None))
    return out


@pytest.mark.parametrize("dtype", list(TYPES), ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(37, 256), (40, 172), (19, 40), (5, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_float_matmul_equals_float64_reference(lib, dtype, shape):
    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=g).to(dtype)
    x = torch.randn(17, shape[1], generator=g)
    r0, r1 = 3, shape[0]
    worst = 0.0
    for B in range(1, 18):
        ref = x[:B].double() @ w[r0:r1].double().T
        got = mat_rows(lib, w, r0, r1, x[:B].contiguous())
        worst = max(worst, ((got.double() - ref).abs().max() / ref.abs().max()).item())
        base = torch.randn(B, r1 - r0, generator=g)
        added = mat_rows(lib, w, r0, r1, x[:B].contiguous(), add_to=base)
        assert torch.allclose(added.double(), base.double() + ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    print(f"{dtype} {shape}: max relative error {worst:.2e}")
    assert worst <= 1e-6


@pytest.mark.parametrize("dtype", list(TYPES), ids=["f32", "f16", "bf16"])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(lib, dtype):
    """The same FMA chains per (row, input) whatever the tile (tile.c's on AVX-512, kernels.c's
    elsewhere): batched logits equal solo logits exactly."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(45, 200, generator=g).to(dtype)
    x = torch.randn(17, 200, generator=g)
    alone = torch.cat([mat_rows(lib, w, 0, 45, x[b:b + 1].contiguous()) for b in range(17)])
    for B in range(2, 18):
        assert torch.equal(mat_rows(lib, w, 0, 45, x[:B].contiguous()), alone[:B]), f"B={B}"
    assert torch.equal(mat_rows(lib, w, 5, 30, x.contiguous()), alone[:, 5:30])   # a chunk of rows
