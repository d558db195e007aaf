"""The families beyond Llama -- Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms before RoPE, head_dim apart
from hidden / heads) and Mistral -- against transformers' own classes with random weights, from Hugging
Face directories and from GGUF files written under llama.cpp's names for each architecture (q/k rows
permuted for llama, as llama.cpp's converter does, and not for qwen2 / qwen3); every attention path and
step form, quantized weights; Qwen's per-layer sliding windows and unknown architectures refused in one line
(Mistral's sliding window: tests/test_sliding_window.py).
Tokenizers (Qwen's and Llama 3's byte-level BPE), chat templates and EOS sets: tests/test_family_chat.py."""
from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch

from engine.api import LLM, load
from engine.loader import load_model
from engine.quant import QuantLinear, dequantize_model
from engine.steps import make_step
from models.config import ModelConfig
from models.errors import CheckpointError, ConfigError

transformers = pytest.importorskip("transformers", reason="transformers not installed (test extra)")

TOL = 1e-4
T = 24
SPECS = {   # family -> (transformers class, config class, settings that make it that family's shape)
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),   # Qwen2.5 <= 3B tie
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=32)),                # 4 x 32 != hidden 64
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None)),
}
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}   # llama.cpp writes Mistral as llama
FAMILY_TENSORS = {"qwen2": ["blk.0.attn_q.bias", "blk.1.attn_k.bias", "blk.1.attn_v.bias"],
                  "qwen3": ["blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"], "mistral": []}
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
            tie_word_embeddings=False)


def hf_random(family: str, seed: int = 0, **overrides):
    """A random model of `family` built with transformers' own class: biases and norm weights far from
    0 and 1, so that a form that dropped them would show."""
    model_cls, config_cls, shape = SPECS[family]
    cfg = getattr(transformers, config_cls)(**{**BASE, **shape, **overrides})
    model = getattr(transformers, model_cls)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module", params=list(SPECS))
def family(request, tmp_path_factory):
    """(name, transformers model, its saved Hugging Face directory)."""
    theirs = hf_random(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(directory)
    return request.param, theirs, directory


def sequence(seed=0, length=T, vocab=97):
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |logit diff| = {d:.3e}")
    return d


def stepwise(model, x, backend):
    """Logits at every position, one token a call through the chosen step form, on the model's own path."""
    step = make_step(model, backend=backend)
    state = model.init_state(x.shape[0], x.shape[1])
    return torch.stack([step(x[:, t:t + 1], state)[:, -1] for t in range(x.shape[1])], 1)


def quiet_load(*args, **kw):
    with warnings.catch_warnings():   # linear paths on softmax weights: UntrainedPathWarning
        warnings.simplefilter("ignore")
        return load(*args, **kw)


# ---------------------------------------------------------------------------- Hugging Face directories
def test_hf_directory_matches_transformers(family):
    name, theirs, directory = family
    ours, _ = load_model(directory, dtype="float32")
    assert ours.config.model_type == name
    x = sequence()
    with torch.no_grad():
        ref = theirs(x).logits
        assert max_diff(ours(x), ref) <= TOL
        for backend in backends(ours):
            assert max_diff(stepwise(ours, x, backend), ref) <= TOL, backend


def backends(model):
    """The step forms to hold to the reference: module, torch, and native where it is built here."""
    return ["module", "torch"] + (["native"] if "native" in make_step(model).forms_available else [])


def test_greedy_ids_equal_transformers(family):
    name, theirs, directory = family
    prompt = sequence(seed=4, length=7)
    ids = prompt[0].tolist()
    with torch.no_grad():
        for _ in range(10):                       # transformers' greedy continuation, one argmax at a time
            ids.append(int(theirs(torch.tensor([ids])).logits[0, -1].argmax()))
    ours = load(str(directory)).generate(prompt[0].tolist(), max_new_tokens=10, temperature=0, ignore_eos=True)
    assert ours.ids == ids[7:]


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_padded_batch_equals_each_alone(family, attention):
    name, theirs, directory = family
    llm = quiet_load(str(directory), attention=attention)
    a, b = sequence(seed=1, length=19)[0].tolist(), sequence(seed=2, length=6)[0].tolist()
    both = llm.generate([a, b], max_new_tokens=6, temperature=0, ignore_eos=True)
    alone = [llm.generate([p], max_new_tokens=6, temperature=0, ignore_eos=True)[0] for p in (a, b)]
    assert [r.ids for r in both] == [r.ids for r in alone]


@pytest.mark.parametrize("path", ["linear", "hybrid", "window"])
def test_every_attention_path_agrees_across_step_forms(family, path):
    """Linear (elu1 after the norm and RoPE), hybrid and linear + window on these families: the parallel
    forward and one token at a time through the module and torch steps give the same logits."""
    name, theirs, directory = family
    options = {"linear": dict(attention="linear"), "hybrid": dict(attention="hybrid", softmax_layers=[1]),
               "window": dict(attention="linear", window=5)}[path]
    ours = quiet_load(str(directory), backend="torch", **options).model
    x = sequence(seed=3)
    with torch.no_grad():
        full = ours(x)
        for backend in ("module", "torch"):
            assert max_diff(stepwise(ours, x, backend), full) <= TOL, backend
        assert max_diff(full, theirs(x).logits) > 100 * TOL   # not the softmax model: the path did change


def test_the_native_step_runs_every_family(family):
    """Qwen2's biases and Qwen3's q/k norms run in the C step too (no fallback), decode and prompt
    blocks, on softmax and linear, and equal transformers / the module path (the test above holds
    the softmax logits; here the form that ran, and the linear path)."""
    name, theirs, directory = family
    ours, _ = load_model(directory)
    try:
        step = make_step(ours, backend="native")
    except Exception as e:   # no C compiler here
        pytest.skip(f"the native step cannot be built here: {e}")
    x = sequence(seed=5, length=12)
    for path in ("softmax", "linear"):
        state = ours.init_state(1, 16, path)
        step(x[:, :8], state, last_only=True)
        got = torch.stack([step(x[:, t:t + 1], state)[:, -1] for t in range(8, 12)], 1)
        assert step.last_form == "native" and step.last_prefill_form == "native" and step.fallback is None
        ref_state = ours.init_state(1, 16, path)
        with torch.no_grad():
            ref = ours.step(x, ref_state)[:, 8:]
        assert max_diff(got, ref) <= TOL, path


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_quantized_forms_equal_dequantize_then_fp32(family, kind):
    """--quantize keeps Qwen2's q/k/v biases beside the blocks: the module path and the torch step on the
    blocks equal the same model dequantized to fp32 (whose biases are the float model's own)."""
    name, theirs, directory = family
    quantized = load(str(directory), quantize=kind, backend="torch").model
    floats, _ = load_model(directory)
    qkv = quantized.layers[0].self_attn.qkv
    assert isinstance(qkv, QuantLinear)
    if name == "qwen2":
        assert torch.equal(qkv.bias, floats.layers[0].self_attn.qkv.bias)
    reference = copy.deepcopy(quantized)
    dequantize_model(reference)
    assert torch.equal(reference.layers[0].self_attn.qkv.bias, floats.layers[0].self_attn.qkv.bias) \
        if name == "qwen2" else reference.layers[0].self_attn.qkv.bias is None
    x = sequence(seed=5)
    with torch.no_grad():
        ref = reference(x)
        assert max_diff(quantized(x), ref) <= 1e-5
        assert max_diff(stepwise(quantized, x, "torch"), ref) <= TOL


def test_our_export_loads_in_transformers(family, tmp_path):
    """save_pretrained writes the family's architecture and keys: transformers' Auto class rebuilds it."""
    from models.weights import save_pretrained
    name, theirs, directory = family
    ours, _ = load_model(directory)
    save_pretrained(ours, str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == [SPECS[name][0]] and raw["model_type"] == name
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again) is type(theirs)
    x = sequence(seed=6)
    with torch.no_grad():
        assert max_diff(again(x).logits, theirs(x).logits) <= TOL


# ---------------------------------------------------------------------------- GGUF, under llama.cpp's names
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")


def write_family_gguf(path, directory, arch, **kw):
    from tests.chat_fixtures import write_gguf
    ours, _ = load_model(directory)
    return ours, write_gguf(path, ours, None, template=None, arch=arch, **kw)


def test_gguf_matches_transformers(family, tmp_path):
    name, theirs, directory = family
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(path, directory, GGUF_ARCH[name])
    reader = gguf.GGUFReader(str(path))       # llama.cpp's own reader sees the names llama.cpp looks for
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "blk.1.attn_q.weight", "blk.1.ffn_down.weight", *FAMILY_TENSORS[name]} <= names
    assert ("output.weight" in names) == (not theirs.config.tie_word_embeddings)
    assert reader.fields["general.architecture"].contents() == GGUF_ARCH[name]
    ours, _ = load_model(path, dtype="float32")
    assert ours.config.model_type == name.replace("mistral", "llama")
    x = sequence(seed=7)
    with torch.no_grad():
        ref = theirs(x).logits
        assert max_diff(ours(x), ref) <= TOL
        for backend in backends(ours):
            assert max_diff(stepwise(ours, x, backend), ref) <= TOL, backend


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_permuting_qwen_rows_as_llamas_would_be_wrong(name, tmp_path):
    """Negative control: a qwen2/qwen3 file read with llama's row permutation gives other logits, so the
    per-architecture handling above is what makes them match."""
    from models.registry import read_checkpoint
    from engine.loader import build
    theirs = hf_random(name)
    theirs.save_pretrained(tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_family_gguf(path, tmp_path / "hf", name)
    ckpt = read_checkpoint(path)
    assert ckpt.interleaved_rotary is False
    wrong = build(ckpt.config, ckpt.tensors, "cpu", torch.float32, interleaved_rotary=True)
    with torch.no_grad():
        assert max_diff(wrong(sequence()), theirs(sequence()).logits) > 100 * TOL


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_gguf_q8_0_blocks_keep_biases_and_match_dequantized(name, tmp_path):
    """A Q8_0 file: its matrices run on their own blocks (QuantLinear), Qwen2's biases beside them as
    floats; logits equal a Hugging Face directory of the same weights dequantized."""
    from gguf import GGMLQuantizationType as Q
    from tests.chat_fixtures import hf_model_from
    theirs = hf_random(name)
    theirs.save_pretrained(tmp_path / "hf")
    path = tmp_path / "q8.gguf"
    ours, stored = write_family_gguf(path, tmp_path / "hf", name,
                                     qtype_of=lambda gname, shape: Q.Q8_0 if shape[-1] % 32 == 0 else Q.F32)
    direct, _ = load_model(path)
    assert isinstance(direct.layers[0].self_attn.qkv, QuantLinear)
    assert (direct.layers[0].self_attn.qkv.bias is not None) == (name == "qwen2")
    floats, _ = load_model(hf_model_from(stored, ours.config, tmp_path / "dequantized"))
    x = sequence(seed=8)
    with torch.no_grad():
        assert max_diff(direct(x), floats(x)) <= TOL
        assert max_diff(stepwise(direct, x, "torch"), floats(x)) <= TOL


def test_gguf_eot_token_joins_the_eos_set(tmp_path):
    """llama.cpp's converter writes Llama 3's <|eot_id|> as tokenizer.ggml.eot_token_id beside EOS: both end."""
    from tests.chat_fixtures import train_bpe
    tok_dir = train_bpe(tmp_path / "tok")          # EOS id 2 (<|im_end|>)
    theirs = hf_random("qwen2", vocab_size=400)
    theirs.save_pretrained(tmp_path / "hf")
    path = tmp_path / "m.gguf"
    ours, _ = load_model(tmp_path / "hf")
    from tests.chat_fixtures import write_gguf
    write_gguf(path, ours, tok_dir, template=None, arch="qwen2", eot_id=7)
    assert load_model(path)[0].config.eos_ids == (2, 7)
    write_gguf(path, ours, tok_dir, template=None, arch="qwen2")
    assert load_model(path)[0].config.eos_ids == (2,)


# ---------------------------------------------------------------------------- refusals, one line each
def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "qwen2moe"])
def test_unsupported_gguf_architecture_is_one_line(arch, tmp_path):
    from tests.chat_fixtures import write_gguf
    ours, _ = load_model(_saved(tmp_path, "mistral"))
    path = tmp_path / "other.gguf"
    write_gguf(path, ours, None, template=None, arch=arch)
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert f"{arch!r}" in one_line(e) and "supported: llama, qwen2, qwen3" in one_line(e)


def test_unsupported_model_type_is_one_line_and_exit_2(tmp_path):
    from click.testing import CliRunner
    from cli.main import main
    directory = _saved(tmp_path, "mistral")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "model_type": "gemma2"}))
    with pytest.raises(ConfigError) as e:
        load_model(directory)
    assert "'gemma2'" in one_line(e) and "supported: llama, mistral, qwen2, qwen3" in one_line(e)
    r = CliRunner().invoke(main, ["--model", str(directory), "--ids", "1,2", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "'gemma2'" in r.stderr


def _saved(tmp_path, family):
    directory = tmp_path / f"{family}-hf"
    hf_random(family).save_pretrained(directory)
    return directory


def test_unexpected_family_tensor_is_refused(tmp_path):
    """A llama file carrying qwen2's biases is not silently run without them."""
    from tests.chat_fixtures import write_gguf
    ours, _ = load_model(_saved(tmp_path, "mistral"))
    path = tmp_path / "llama-with-bias.gguf"
    bias = np.zeros(64, dtype=np.float32)
    write_gguf(path, ours, None, template=None, arch="llama", extra_tensors={"blk.0.attn_q.bias": bias})
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert "blk.0.attn_q.bias" in one_line(e)


SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=97,
             max_position_embeddings=128)


@pytest.mark.parametrize("raw, refused", [
    ({"model_type": "mistral", "sliding_window": 16}, False),          # Mistral-7B-v0.1's shape: runs (a ring)
    ({"model_type": "mistral", "sliding_window": 128}, False),         # the window covers the whole context
    ({"model_type": "mistral", "sliding_window": None}, False),        # v0.2 and later
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}, True),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}, False),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0}, False),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 32,
      "layer_types": ["full_attention", "sliding_attention"]}, True),
    ({"model_type": "llama", "sliding_window": 16}, False),            # not a Llama key
], ids=["mistral-16", "mistral-128", "mistral-null", "qwen2-on", "qwen2-no-layer", "qwen2-off", "qwen3-layer",
        "llama"])
def test_sliding_window_the_context_can_outgrow_is_refused(raw, refused):
    """As transformers decides which layers slide; Qwen2/3's per-layer window refused (one line, naming it)
    where a window shorter than the context would bite; Mistral's runs (tests/test_sliding_window.py)."""
    if not refused:
        ModelConfig.from_dict({**SMALL, **raw})
        return
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**SMALL, **raw})
    assert "sliding_window 32" in one_line(e) or "sliding_window 16" in one_line(e)


def test_sliding_window_refusal_matches_transformers_layers():
    """The layers transformers makes sliding for the refused Qwen2 case exist; for the accepted one none do."""
    on = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=32, max_window_layers=0)
    off = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert "sliding_attention" in on.layer_types and "sliding_attention" not in off.layer_types


def test_qwen3_head_dim_defaults_to_transformers():
    cfg = ModelConfig.from_dict({**SMALL, "hidden_size": 1024, "num_attention_heads": 16, "model_type": "qwen3"})
    assert cfg.head_dim == transformers.Qwen3Config().head_dim == 128


def test_llama_attention_bias_is_still_refused():
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**SMALL, "attention_bias": True})
    assert "attention_bias" in one_line(e)


def test_generation_config_eos_joins_the_config(family, tmp_path):
    """Qwen2.5-Instruct: config.json's EOS is <|im_end|>, generation_config.json adds <|endoftext|>."""
    import shutil
    name, theirs, directory = family
    copy_dir = tmp_path / "m"
    shutil.copytree(directory, copy_dir)
    raw = json.loads((copy_dir / "config.json").read_text())
    (copy_dir / "config.json").write_text(json.dumps({**raw, "eos_token_id": 5}))
    (copy_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    ours, _ = load_model(copy_dir)
    assert ours.config.eos_ids == (5, 9)
    (copy_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError) as e:
        load_model(copy_dir)
    assert "generation_config.json" in one_line(e)


def test_linear_path_with_q_norm_applies_the_map_after_the_norm():
    """Qwen3's linear path: the feature map sees q and k after q_norm / k_norm and RoPE (the module's
    order), checked against a hand-written computation of layer 0's attention."""
    import torch.nn.functional as F
    from engine.attention import get_feature_map, linear_attention_reference
    from engine.transformer import Transformer, apply_rotary, rms_norm
    cfg = ModelConfig.from_dict({**SMALL, "model_type": "qwen3", "head_dim": 32, "num_key_value_heads": 2,
                                 "rms_norm_eps": 1e-5})
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * (0.08 if p.dim() >= 2 else 0.3) + (0 if p.dim() >= 2 else 1))
    attn, x = model.layers[0].self_attn, torch.randn(1, 9, 64)
    q, k, v = F.linear(x, attn.qkv.weight).split([4 * 32, 2 * 32, 2 * 32], -1)
    q = rms_norm(q.view(1, 9, 4, 32), attn.q_norm.weight, 1e-5, 32).transpose(1, 2)
    k = rms_norm(k.view(1, 9, 2, 32), attn.k_norm.weight, 1e-5, 32).transpose(1, 2)
    cos, sin = model.rotary(torch.arange(9)[None], x.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    expected = linear_attention_reference(q, k, v.view(1, 9, 2, 32).transpose(1, 2), get_feature_map("elu1"))[0]
    seen = {}

    def attend(q_, k_, v_):
        seen["out"] = linear_attention_reference(q_, k_, v_, get_feature_map("elu1"))[0]
        return seen["out"]
    with torch.no_grad():
        attn(x, (cos, sin), attend, linear=True)
    assert max_diff(seen["out"], expected) <= 1e-6


@pytest.mark.parametrize("how", ["merged", "attached"])
def test_adapters_over_biased_projections_keep_the_bias(how, tmp_path):
    """LoRA on Qwen2's qkv (gen linearize --lora-rank): the adapted projection is the base's matrix plus
    B A and the base's bias. With B = 0 the adapted linear path is the plain linear path, in the module
    and the torch step (which reads the adapted weight and bias)."""
    from engine.adapters import LoRA, attach, merge
    model = quiet_load(str(_saved(tmp_path, "qwen2")), attention="linear", backend="torch").model
    x = sequence(seed=9)
    with torch.no_grad():
        plain = model(x)
        lora = LoRA.for_config(model.config, rank=2)
        merge(model, lora.export()) if how == "merged" else attach(model, lora)
        assert model.layers[0].self_attn.adapted[0].bias is not None
        assert max_diff(model(x), plain) <= 1e-5
        assert max_diff(stepwise(model, x, "torch"), plain) <= TOL


def test_linearize_runs_on_qwen3(tmp_path):
    """gen linearize on a Qwen3 (q/k norms, head_dim 32 != 64 / 4): a couple of transfer steps lower the
    loss and the maps load back onto the model."""
    from engine.linearize import LinearizeArgs, linearize
    from tests.chat_fixtures import train_bpe
    directory = train_bpe(tmp_path / "m")      # tokenizer.json (400 tokens) + tokenizer_config.json
    hf_random("qwen3", vocab_size=400).save_pretrained(directory)
    data = tmp_path / "text.txt"
    from tests.conftest import generated_sentences
    sents = generated_sentences(120, seed=1)
    data.write_text("\n<|endoftext|>\n".join(" ".join(sents[i:i + 5]) for i in range(0, 120, 5)))
    out = tmp_path / "lin"
    linearize(LinearizeArgs(model=str(directory), data=[str(data)], out=str(out), seq_len=32, tokens=256,
                            eval_rows=2, layer_steps=3, batch_size=2, finetune_steps=1, finetune_batch=2, seed=3),
              log=lambda m: None)
    losses = json.loads((out / "transfer_losses.json").read_text())["layers"]
    assert all(rec["loss"] < rec["loss_before"] for rec in losses)
    model, _ = load_model(out)
    assert model.config.model_type == "qwen3" and model.config.feature_map == "hedgehog"
    assert model.hedgehog.q_weight.shape[-1] == 32
