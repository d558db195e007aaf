"""GGUF files: a tiny random Llama written with the gguf package's writer (llama.cpp's layout: q/k rows
permuted for its rotary, tensors quantized) loads into exactly the weights it stores, in every
supported tensor type; bad files are one-line errors."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")
pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from chat_fixtures import hf_model_from, logits, train_bpe, write_gguf  # noqa: E402
from conftest import tiny_model  # noqa: E402
from engine.loader import load_model  # noqa: E402
from models.errors import CheckpointError, ConfigError  # noqa: E402
from engine.quant import BLOCK_BYTES, QuantLinear, QuantStack  # noqa: E402
from models.gguf import BLOCK_KINDS, SUPPORTED_TYPES, read_gguf  # noqa: E402

# hidden and intermediate sizes are multiples of 256 so that every row fits K-quant blocks
CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=400, max_position_embeddings=128, rope_theta=10000.0)
IDS = [5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 3, 311]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, **CFG)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K,
                                   Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_gguf_loads_exactly_the_weights_it_stores(tmp_path, model, tok_dir, qtype):
    """Every runtime weight equals the tensor the file stores, dequantized by the gguf package and put
    back in Hugging Face row order: the q/k un-permutation and the name mapping are exact for every type."""
    path = tmp_path / "m.gguf"
    stored = write_gguf(path, model, tok_dir, qtype_of=lambda name, shape: qtype)
    from_gguf, tok = load_model(path)
    from_hf, _ = load_model(hf_model_from(stored, model.config, tmp_path / "hf"))
    sd_a, sd_b = effective_weights(from_gguf), from_hf.state_dict()
    assert sd_a.keys() == sd_b.keys()
    kept = qtype.name.lower() if qtype.name in BLOCK_KINDS else None   # the file's blocks, undecoded
    assert {getattr(m, "kind", None) for m in matrices(from_gguf)} == {kept}
    worst = max(float((sd_a[k] - sd_b[k]).abs().max()) for k in sd_a)
    print(f"{qtype.name}: max weight difference {worst}")
    assert worst == 0.0
    assert torch.equal(logits(from_gguf, IDS), logits(from_hf, IDS))
    assert tok is not None and tok.vocab_size == model.config.vocab_size


def matrices(model) -> list:
    """The modules of every matrix a GGUF tensor of a block type can become (qkv, o, gate_up, down, lm_head)."""
    per_layer = [m for b in model.layers for m in (b.self_attn.qkv, b.self_attn.o_proj, b.mlp.gate_up, b.mlp.down_proj)]
    return per_layer + [model.lm_head]


def effective_weights(model) -> dict[str, torch.Tensor]:
    """state_dict with each QuantLinear's blocks replaced by its dequantized weight (`X.weight`)."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith(".blocks"):
            k = k.removesuffix(".blocks") + ".weight"
            v = model.get_submodule(k.removesuffix(".weight")).weight
        out[k] = v
    return out


# How far each type's logits may move from the fp32 original (relative RMS): F32 exact; F16 / BF16
# by their mantissas (11 / 8 bits: ~5e-4 / 4e-3 per weight); a Q8_0 block rounds to 1/254 of its
# largest weight, Q5_1 to 1/62 of its range, Q4_0 to 1/30 of its largest: each step down the list
# roughly 4-8x coarser. The bounds are ~2x what this random model measures; a wrong q/k row order
# gives ~1 (and the exact test above catches any mapping error on its own).
QUANT_TOLERANCE = {Q.F32: 0.0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 4e-2, Q.Q5_1: 0.25, Q.Q4_0: 0.6}


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_gguf_logits_near_the_original_weights(tmp_path, model, tok_dir, qtype):
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir, qtype_of=lambda name, shape: qtype)
    loaded, _ = load_model(path)
    ref = logits(model, IDS)
    err = float((logits(loaded, IDS) - ref).norm() / ref.norm())
    print(f"{qtype.name}: relative RMS logit difference {err:.2e}")
    assert err <= QUANT_TOLERANCE[qtype]


def test_mixed_types_and_tied_embeddings(tmp_path, tok_dir):
    """SmolLM2's mix (Q8_0 embedding, Q4_1 matrices, F32 norms) and no output.weight: lm_head is the embedding."""
    m = tiny_model(seed=12, tie_word_embeddings=True, **CFG)
    path = tmp_path / "tied.gguf"
    stored = write_gguf(path, m, tok_dir,
                        qtype_of=lambda name, shape: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1)
    cfg, tensors, _ = read_gguf(path)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in tensors
    loaded, _ = load_model(path)
    assert torch.equal(loaded.embed_tokens.weight, stored["model.embed_tokens.weight"])   # dequantized table
    head = loaded.lm_head                       # the embedding's own Q8_0 blocks, for the dot products
    assert isinstance(head, QuantLinear) and head.kind == "q8_0"
    assert torch.equal(head.blocks, tensors.blocks("model.embed_tokens.weight")[0])
    assert torch.equal(head.weight, loaded.embed_tokens.weight)
    assert {m.kind for m in matrices(loaded)[:-1]} == {"q4_1"}


def test_blocks_are_the_files_bytes(tmp_path, model, tok_dir):
    """A Q8_0/Q4_0/Q4_1 matrix holds the file's bytes: q/k rows moved back to half-split pairs and
    q/k/v, gate/up concatenated, whole rows of blocks, never decoded (layouts byte-identical to
    engine.quant's); parts of mixed kinds (here k as Q4_0 next to q/v as Q8_0) are a QuantStack of their
    own bytes, q/k rows moved as well (segments q8_0, q4_0, q8_0)."""
    from models.weights import interleaved_to_half
    kinds = {"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q8_0, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q4_0,
             "ffn_gate.weight": Q.Q4_1, "ffn_up.weight": Q.Q4_1, "ffn_down.weight": Q.Q8_0, "output.weight": Q.Q4_0}
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir, qtype_of=lambda name, shape: Q.Q4_0 if name == "blk.1.attn_k.weight"
               else kinds.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, Q.F32))
    loaded, _ = load_model(path)
    raw = {t.name: torch.from_numpy(np.asarray(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
    cfg = model.config
    qkv = loaded.layers[0].self_attn.qkv
    q = interleaved_to_half(raw["blk.0.attn_q.weight"], cfg.num_attention_heads).reshape(-1, raw["blk.0.attn_q.weight"].shape[1])
    k = interleaved_to_half(raw["blk.0.attn_k.weight"], cfg.num_key_value_heads).reshape(-1, raw["blk.0.attn_k.weight"].shape[1])
    assert qkv.kind == "q8_0" and torch.equal(qkv.blocks, torch.cat([q, k, raw["blk.0.attn_v.weight"]]))
    gu = loaded.layers[0].mlp.gate_up
    assert gu.kind == "q4_1" and torch.equal(gu.blocks, torch.cat([raw["blk.0.ffn_gate.weight"], raw["blk.0.ffn_up.weight"]]))
    assert torch.equal(loaded.layers[1].self_attn.o_proj.blocks, raw["blk.1.attn_output.weight"])
    assert torch.equal(loaded.lm_head.blocks, raw["output.weight"]) and loaded.lm_head.kind == "q4_0"
    mixed = loaded.layers[1].self_attn.qkv
    assert isinstance(mixed, QuantStack) and mixed.parts == (("q8_0", 256), ("q4_0", 128), ("q8_0", 128))
    q1 = interleaved_to_half(raw["blk.1.attn_q.weight"], cfg.num_attention_heads).reshape(raw["blk.1.attn_q.weight"].shape)
    k1 = interleaved_to_half(raw["blk.1.attn_k.weight"], cfg.num_key_value_heads).reshape(raw["blk.1.attn_k.weight"].shape)
    assert torch.equal(mixed.blocks, torch.cat([q1.flatten(), k1.flatten(), raw["blk.1.attn_v.weight"].flatten()]))
    assert qkv.blocks.shape == (qkv.out_features, qkv.in_features // 32 * BLOCK_BYTES["q8_0"])


def test_gguf_q4_1_decodes_natively_as_its_reference(tmp_path, model, tok_dir, monkeypatch):
    """SmolLM2's mix (Q4_1 matrices, tied Q8_0 embedding) loaded as blocks runs the native step, which
    equals the module path computing the same way (engine.quant.q8_reference) to 1e-5. On the blocks as
    stored: the grouped kernels (AVX-512 VNNI builds) sum in another order, so now and then an activation
    rounds to the next q8 step and one token's logits move by ~1e-2 (tests/test_quant.py holds those
    kernels to the stored blocks' integer dots)."""
    import engine.steps.native as native
    from engine.quant import q8_reference
    from engine.steps import NativeUnavailableError, Stepper
    from engine.steps.native import library
    monkeypatch.setattr(native, "REGROUP", False)
    try:
        library()
    except NativeUnavailableError as e:
        pytest.skip(f"native decode step unavailable here: {e}")
    m = tiny_model(seed=12, tie_word_embeddings=True, **CFG)
    path = tmp_path / "tied.gguf"
    write_gguf(path, m, tok_dir, qtype_of=lambda name, shape: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1)
    loaded, _ = load_model(path)
    ref = q8_reference(loaded)
    state, twin = loaded.init_state(1, 32), loaded.init_state(1, 32)
    for s in (state, twin):
        loaded.step(torch.tensor([IDS[:4]]), s)      # the same PyTorch prefill
    step, worst = Stepper(loaded, "native", threads=2), 0.0
    for t in IDS[4:]:
        got = step(torch.tensor([[t]]), state)
        assert step.last_form == "native"
        worst = max(worst, (got - ref.step(torch.tensor([[t]]), twin)).abs().max().item())
    print(f"native vs q8 reference: max |logit diff| {worst:.1e}")
    assert worst <= 1e-5


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_fused_qkv_copy_is_held_once_grouped(tmp_path, model, tok_dir, qtype):
    """The loader's fused q/k/v is a copy of its own (q/k rows permuted); the native step holds it in
    its grouped layout in place (QuantLinear.group) instead of a regrouped copy beside it, and every
    step form computes what the stored layout gives, bit for bit: f32-prompt (grouped kernels), f32
    activations (the fp32 kernels read the grouped layout) and q8 with regroup off (a copy as stored)."""
    from engine.steps.native import NativeStep, library
    from engine.steps import NativeUnavailableError
    try:
        lib = library()
    except NativeUnavailableError as e:
        pytest.skip(f"native decode step unavailable here: {e}")
    if not lib.gen_has_q4_1r():
        pytest.skip("this build has no grouped kernels (AVX-512 VNNI): nothing is regrouped")
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir, qtype_of=lambda name, shape: qtype)
    (held, _), (beside, _) = load_model(path), load_model(path)
    for b in beside.layers:
        b.self_attn.qkv.own = False   # as before: the step makes a regrouped copy beside the model's

    def run(net, **options):
        step = NativeStep(net, threads=2, **options)
        state = net.init_state(1, 32)
        out = [step.prefill(torch.tensor([IDS[:5]]), state)]
        out += [step(torch.tensor([[t]]), state) for t in IDS[5:]]
        copies = [k for k, (_, _, c) in step.weights._cache.items() if c is not None]
        return torch.cat(out, 1), copies

    for options in ({"activations": "f32-prompt"}, {"activations": "f32"}, {"activations": "q8", "regroup": False}):
        (got, copies), (want, copies_beside) = run(held, **options), run(beside, **options)
        assert torch.equal(got, want), options
        assert all(b.self_attn.qkv.grouped for b in held.layers) and not beside.layers[0].self_attn.qkv.grouped
        qkv = {id(b.self_attn.qkv.blocks) for b in held.layers}
        made = [k for k in copies if k[1] in qkv]
        assert len(made) == (2 if options.get("regroup") is False else 0), options   # regroup off: as stored
        if options["activations"] == "f32-prompt":   # beside: a regrouped copy of each layer's q/k/v too
            assert len(copies_beside) == len(copies) + 2


def test_config_from_metadata(tmp_path, model, tok_dir):
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir)
    cfg, _, meta = read_gguf(path)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "rope_theta", "head_dim"):
        assert getattr(cfg, key) == getattr(model.config, key), key
    assert cfg.rms_norm_eps == pytest.approx(model.config.rms_norm_eps)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert meta["tokenizer.ggml.model"] == "gpt2"


def test_gguf_tensors_are_views_of_the_map_for_f32(tmp_path, model, tok_dir):
    """F32 matrices are not copied out of the file: the reader hands out views of its map. A norm (a
    few KB, read every token) is a copy, so no read of the map faults its neighbours' pages back in."""
    from models.gguf import SMALL_FLOATS
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir)
    _, tensors, _ = read_gguf(path)
    name = "model.layers.0.mlp.gate_proj.weight"
    a, b = tensors[name], tensors[name]
    assert a.numel() * 4 >= SMALL_FLOATS and a.data_ptr() == b.data_ptr()
    base, size = tensors.reader.data.ctypes.data, tensors.reader.data.nbytes
    assert base <= a.data_ptr() < base + size
    n = tensors["model.norm.weight"]
    assert not base <= n.data_ptr() < base + size and torch.equal(n, tensors["model.norm.weight"])


# ---------------------------------------------------------------------- bad files
def load_error(path, error=CheckpointError) -> str:
    """The one-line message load_model(path) refuses the file with."""
    with pytest.raises(error) as e:
        load_model(path)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_wrong_magic(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + b"\0" * 100)
    assert "not a GGUF file" in load_error(path)


def test_truncated(tmp_path, model, tok_dir):
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir)
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 50):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        assert "truncated" in load_error(short)


@pytest.mark.parametrize("key,value,says", [("attention.head_count", 0, "num_attention_heads must be a positive"),
                                            ("context_length", 0, "max_position_embeddings must be a positive")])
def test_a_zero_in_the_metadata_is_one_line(tmp_path, model, tok_dir, key, value, says):
    """A head count of 0 divided by zero in the loader (a traceback); a context length of 0 reached
    gen eval's buffers. Both are the config's one line now."""
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir)
    field = gguf.GGUFReader(str(path), "r+").fields[f"llama.{key}"]
    field.parts[field.data[0]][0] = value   # rewritten in place (a memory map of the file)
    assert says in load_error(path, ConfigError)


def test_other_architecture(tmp_path, model, tok_dir):
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir, arch="gpt2")
    msg = load_error(path)
    assert "'gpt2'" in msg and "supported: llama" in msg


def test_unsupported_tensor_type(tmp_path, model, tok_dir):
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir, qtype_of=lambda name, shape: Q.Q8_0)
    # copy the file through the writer with one tensor retyped as Q2_K (a type we do not dequantize)
    import numpy as np
    w = gguf.GGUFWriter(str(tmp_path / "q2.gguf"), "llama")
    r = gguf.GGUFReader(str(path))
    for f in r.fields.values():
        if f.name.startswith(("GGUF.", "general.architecture")):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub)
    for t in r.tensors:
        if t.name == "blk.0.ffn_up.weight":
            rows, cols = int(t.shape[1]), int(t.shape[0])
            block, size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
            w.add_tensor(t.name, np.zeros((rows, cols // block * size), dtype=np.uint8), raw_dtype=Q.Q2_K)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    msg = load_error(tmp_path / "q2.gguf")
    assert "blk.0.ffn_up.weight" in msg and "Q2_K" in msg and ", ".join(SUPPORTED_TYPES) in msg


def test_rope_scaling_refused(tmp_path, model, tok_dir):
    import gguf as g
    path = tmp_path / "m.gguf"
    orig = g.GGUFWriter.write_header_to_file

    def with_scaling(self, *a, **k):
        self.add_rope_scaling_type(g.RopeScalingType.YARN)
        return orig(self, *a, **k)
    g.GGUFWriter.write_header_to_file = with_scaling
    try:
        write_gguf(path, model, tok_dir)
    finally:
        g.GGUFWriter.write_header_to_file = orig
    assert "rope.scaling.type" in load_error(path, ConfigError)


def test_directory_named_gguf_and_copy(tmp_path, model, tok_dir):
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir)
    shutil.copy(path, tmp_path / "M.GGUF")
    a, _ = load_model(tmp_path / "M.GGUF")
    assert torch.equal(logits(a, IDS), logits(load_model(path)[0], IDS))


def test_a_gguf_named_without_its_suffix_is_read_by_its_signature(tmp_path, model, tok_dir):
    """A hub blob or a link named without .gguf: the file's first bytes decide, not the name (it was read
    as a llama2.c header: "implausible header (dim=1179993927, ...)", the bytes of "GGUF")."""
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir)
    (tmp_path / "blob").symlink_to(path)
    a, tok = load_model(tmp_path / "blob")
    assert tok is not None and torch.equal(logits(a, IDS), logits(load_model(path)[0], IDS))
    (tmp_path / "other").write_bytes(b"GGUG" + bytes(100))   # not the signature: llama2.c's reader says why
    assert "not a llama2.c checkpoint" in load_error(tmp_path / "other")


def test_each_tensor_is_dequantized_once_per_load(tmp_path, model, tok_dir, monkeypatch):
    """The model is built tensor by tensor from the map: every tensor read once, none held twice."""
    from models.gguf import GGUFTensors
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok_dir, qtype_of=lambda name, shape: Q.Q8_0)
    reads: dict[str, int] = {}
    real = GGUFTensors.__getitem__

    def counted(self, name):
        reads[name] = reads.get(name, 0) + 1
        return real(self, name)
    monkeypatch.setattr(GGUFTensors, "__getitem__", counted)
    load_model(path)
    assert reads and set(reads.values()) == {1}, reads
    assert not any(n.endswith(("proj.weight", "lm_head.weight")) for n in reads), "Q8_0 matrices were decoded"
