"""A GGUF token embedding stored as blocks stays those blocks (engine.quant.QuantEmbedding): the model
holds no float table of the embedding's shape, a tied lm_head reads the very same tensor, and every
step form (module, torch, native with f32 and q8 activations) gives the logits -- bit for bit -- and
greedy ids of the old load, which dequantized the whole table. Fused q/k/v blocks are copies, so
the loader drops the file pages they were read from (GGUFTensors.release); the map stays readable
after. gate/up, back to back in the file, fuse as a view of the map (GGUFTensors.blocks_span). (Resident memory itself: benchmarks/load_memory.py; no sizes are asserted here.)"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from chat_fixtures import write_gguf  # noqa: E402
from conftest import tiny_model  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.quant import QuantEmbedding, QuantLinear, dequantize_model  # noqa: E402
from engine.steps import Stepper  # noqa: E402
from models.gguf import read_gguf  # noqa: E402

# rows of 256: every kind fits (K-quant super-blocks)
CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=300, max_position_embeddings=128, rope_theta=10000.0)
PROMPT = torch.tensor([[5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 3]])
# embedding kind, the matrices' kind, tied: SmolLM2's mix, Llama-3.2-1B Q4_K_M's, an untied K-quant table,
# and Q5_0 / Q5_1 tables (llama-quantize's fallback types for rows that are no multiple of 256)
MIXES = {"q8_0-tied": (Q.Q8_0, Q.Q4_1, True), "q6_k-tied": (Q.Q6_K, Q.Q4_K, True),
         "q4_k-untied": (Q.Q4_K, Q.Q4_K, False), "q5_0-tied": (Q.Q5_0, Q.Q5_0, True),
         "q5_1-untied": (Q.Q5_1, Q.Q5_1, False)}


@pytest.fixture(scope="module", params=list(MIXES))
def mix(request, tmp_path_factory):
    embed, base, tied = MIXES[request.param]
    path = tmp_path_factory.mktemp("qe") / f"{request.param}.gguf"
    kinds = {"token_embd.weight": embed, "output.weight": Q.Q6_K}   # (no output.weight when tied)
    qtype_of = lambda name, shape: kinds.get(name, base)  # noqa: E731
    stored = write_gguf(path, tiny_model(seed=5, tie_word_embeddings=tied, **CFG), None, qtype_of=qtype_of,
                        template=None)
    model, _ = load_model(path)
    return request.param, path, stored, model


def old_load(model):
    """The same model with the embedding dequantized whole into an nn.Embedding (the load before)."""
    old = copy.deepcopy(model)
    old.embed_tokens = nn.Embedding.from_pretrained(model.embed_tokens.table(), freeze=True)
    old.weights_epoch += 1
    return old


def float_tables(model, shape) -> list[str]:
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_floating_point() and tuple(t.shape) == tuple(shape)]


def test_embedding_stays_blocks(mix):
    name, path, stored, model = mix
    cfg = model.config
    emb = model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and emb.kind == MIXES[name][0].name.lower()
    assert float_tables(model, (cfg.vocab_size, cfg.hidden_size)) == []      # no fp32 copy of the table
    if cfg.tie_word_embeddings:   # the tied head reads the same bytes
        assert type(model.lm_head) is QuantLinear and model.lm_head.blocks.data_ptr() == emb.blocks.data_ptr()
    want = stored["model.embed_tokens.weight"]                                 # gguf's own dequantization
    ids = torch.tensor([[0, 7], [299, 7]])
    assert torch.equal(emb(ids), want[ids])
    assert torch.equal(emb.weight[3:9], want[3:9]) and torch.equal(emb.weight, want)
    assert model.dtype == torch.float32 and emb.weight.shape == want.shape
    assert old_load(model).embed_tokens.weight.shape == want.shape            # (the twin below is real)


def greedy(step, model, path: str, n: int = 8):
    """Prompt block then n greedy steps: (logits (1 + n, V), ids)."""
    state = model.init_state(1, 32, path)
    out = [step(PROMPT, state, last_only=True)[0, -1]]
    ids = []
    for _ in range(n):
        ids.append(int(out[-1].argmax()))
        out.append(step(torch.tensor([[ids[-1]]]), state)[0, -1])
    return torch.stack(out), ids


FORMS = [("module", {}), ("torch", {}), ("native", {"activations": "f32"}), ("native", {"activations": "q8"})]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f[0] + "-" + f[1].get("activations", ""))
def test_every_step_form_equals_the_dequantized_table(request, mix, form):
    """Prefill and decode on each form read the embedding's rows as the old load's float table held
    them: the same logits bit for bit, the same greedy ids (softmax and linear paths)."""
    _, _, _, model = mix
    old = old_load(model)
    backend, kw = form
    if backend == "native":
        request.getfixturevalue("native_built")   # skips, saying why, without a compiler
    for path in ("softmax", "linear"):
        got, ids = greedy(Stepper(model, backend, threads=2, **kw), model, path)
        want, want_ids = greedy(Stepper(old, backend, threads=2, **kw), old, path)
        assert torch.equal(got, want) and ids == want_ids


def test_dequantize_model_and_half(mix):
    """dequantize_model gives the embedding back as an nn.Embedding of the same table; .half() moves
    the lookups' dtype (and the model's) as it moved a float table's."""
    _, _, stored, model = mix
    floats = copy.deepcopy(model)
    dequantize_model(floats)
    assert type(floats.embed_tokens) is nn.Embedding
    assert torch.equal(floats.embed_tokens.weight, stored["model.embed_tokens.weight"])
    half = copy.deepcopy(model).half()
    assert half.dtype == torch.float16 and half.embed_tokens(PROMPT).dtype == torch.float16
    assert torch.equal(half.embed_tokens(PROMPT), stored["model.embed_tokens.weight"][PROMPT].half())


def test_fused_parts_release_their_pages(mix, monkeypatch):
    """The loader releases exactly the parts it copied (q, k, v: q/k rows permuted), never a matrix it
    keeps as a view of the map (o, down, the embedding, lm_head, gate_up: gate and up lie back to
    back in the file); a released tensor still reads the file's bytes."""
    from models.gguf import GGUFTensors
    _, path, _, model = mix
    released = []
    monkeypatch.setattr(GGUFTensors, "release", lambda self, name: released.append(name), raising=True)
    load_model(path)
    want = {f"model.layers.{i}.self_attn.{p}.weight" for i in range(model.config.num_hidden_layers)
            for p in ("q_proj", "k_proj", "v_proj")}
    assert sorted(released) == sorted(want)
    monkeypatch.undo()
    _, tensors, _ = read_gguf(path)
    q = "model.layers.0.self_attn.q_proj.weight"
    before = tensors.blocks(q)[0].clone()
    tensors.release(q)
    assert torch.equal(tensors.blocks(q)[0], before)


def test_adjacent_parts_fuse_without_a_copy(mix):
    """gate and up, stored back to back, are fused as one view of the file's map (no anonymous copy
    of ~1/3 of a model's bytes): gate_up's blocks start at gate's bytes and hold gate's then up's."""
    from engine.loader import build
    from models.registry import read_checkpoint
    _, path, _, _ = mix
    ckpt = read_checkpoint(path)
    model = build(ckpt.config, ckpt.tensors, "cpu", torch.float32, interleaved_rotary=ckpt.interleaved_rotary)
    for i, layer in enumerate(model.layers):
        gate, up = (ckpt.tensors.blocks(f"model.layers.{i}.mlp.{p}_proj.weight")[0] for p in ("gate", "up"))
        fused = layer.mlp.gate_up.blocks
        assert fused.data_ptr() == gate.data_ptr()
        assert torch.equal(fused.reshape(-1), torch.cat([gate.reshape(-1), up.reshape(-1)]))
    q = ckpt.tensors.blocks("model.layers.0.self_attn.q_proj.weight")[0]   # permuted: a copy
    assert model.layers[0].self_attn.qkv.blocks.data_ptr() != q.data_ptr()
    assert ckpt.tensors.blocks_span(["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"]) is None


def test_floor_counts_a_row_of_blocks(mix):
    """The bandwidth floor's bytes read per step count one embedding row per sequence as stored."""
    from engine.bench.floor import weight_bytes_read
    _, _, _, model = mix
    one, two = (weight_bytes_read(model, model.init_state(b, 8, "softmax")) for b in (1, 2))
    emb = model.embed_tokens
    assert two - one == emb.blocks.numel() // model.config.vocab_size < model.config.hidden_size * 4
