"""config.json: Hugging Face Llama key names in and out, errors that name the key and the file."""
import json

import pytest

from engine.errors import ConfigError
from models.config import ModelConfig

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 97, "model_type": "llama"}


def write(tmp_path, raw):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_roundtrip(tmp_path):
    cfg = ModelConfig(**{k: v for k, v in BASE.items()}, num_key_value_heads=2, eos_token_id=(2, 7),
                      attention="linear", feature_map="cos1", trained_for=("softmax", "linear"))
    cfg.to_json(tmp_path / "config.json")
    back = ModelConfig.from_json(tmp_path / "config.json")
    assert back == cfg
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["eos_token_id"] == [2, 7] and raw["num_key_value_heads"] == 2 and raw["head_dim"] == 16


def test_defaults_and_derived_fields(tmp_path):
    cfg = ModelConfig.from_json(write(tmp_path, BASE))
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16 and cfg.eos_ids == (2,)
    assert cfg.attention == "softmax" and cfg.trained_for == ("softmax",)


def test_rope_parameters_spelling(tmp_path):
    cfg = ModelConfig.from_json(write(tmp_path, {**BASE, "rope_parameters": {"rope_theta": 500000.0,
                                                                             "rope_type": "default"}}))
    assert cfg.rope_theta == 500000.0
    assert ModelConfig.from_json(write(tmp_path, {**BASE, "rope_theta": 1234.0})).rope_theta == 1234.0


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers"])
def test_missing_key_names_key_and_file(tmp_path, key):
    raw = {k: v for k, v in BASE.items() if k != key}
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError, match=f"{path}.*missing required key '{key}'"):
        ModelConfig.from_json(path)


def test_unsupported_model_type_names_supported(tmp_path):
    path = write(tmp_path, {**BASE, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match=r"config.json: unsupported model_type 'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        ModelConfig.from_json(path)


def test_a_config_without_model_type_takes_its_family_from_architectures(tmp_path):
    """No model_type: architectures names the family; a class of no supported family is refused (a
    GemmaForCausalLM config ran as a Llama); neither key: a bare Llama config, as before."""
    bare = {k: v for k, v in BASE.items() if k != "model_type"}
    assert ModelConfig.from_json(write(tmp_path, bare)).model_type == "llama"
    for cls, family in [("MistralForCausalLM", "mistral"), ("Qwen2ForCausalLM", "qwen2"), ("LlamaForCausalLM", "llama")]:
        assert ModelConfig.from_json(write(tmp_path, {**bare, "architectures": [cls]})).model_type == family
    with pytest.raises(ConfigError, match=r"no model_type, and architectures \['GemmaForCausalLM'\] names no supported"):
        ModelConfig.from_json(write(tmp_path, {**bare, "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ConfigError, match="architectures must be a list of class names"):
        ModelConfig.from_json(write(tmp_path, {**bare, "architectures": {"a": 1}}))
    with pytest.raises(ConfigError, match="unsupported model_type ''"):   # given, and empty: not a family
        ModelConfig.from_json(write(tmp_path, {**bare, "model_type": "", "architectures": ["LlamaForCausalLM"]}))


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "awq"])
def test_a_quantized_checkpoint_is_refused(tmp_path, method):
    """quantization_config (its tensors packed integers or bnb blocks) ran over whatever tensors matched."""
    with pytest.raises(ConfigError, match=f"a {method}-quantized checkpoint .* give the float weights"):
        ModelConfig.from_json(write(tmp_path, {**BASE, "quantization_config": {"quant_method": method, "bits": 4}}))
    with pytest.raises(ConfigError, match="a quantized checkpoint"):
        ModelConfig.from_json(write(tmp_path, {**BASE, "quantization_config": "x"}))


@pytest.mark.parametrize("bad,match", [({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
                                       ({"attention": "flash"}, "attention must be one of softmax, linear"),
                                       ({"hidden_act": "gelu"}, "unsupported setting hidden_act"),
                                       ({"hidden_size": -1}, "hidden_size must be a positive integer"),
                                       ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive"),
                                       ({"max_position_embeddings": -4}, "max_position_embeddings must be a positive"),
                                       ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number >= 0"),
                                       ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number >= 0"),
                                       ({"rope_theta": 0}, "rope_theta must be a finite number > 0"),
                                       ({"rope_theta": float("inf")}, "rope_theta must be a finite number > 0")],
                         ids=["kv-heads", "attention", "act", "negative", "no-positions", "negative-positions",
                              "eps-nan", "eps-negative", "theta-zero", "theta-inf"])
def test_bad_values(tmp_path, bad, match):
    path = write(tmp_path, {**BASE, **bad})
    with pytest.raises(ConfigError, match=match) as info:
        ModelConfig.from_json(path)
    assert str(path) in str(info.value)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path / "config.json")


@pytest.mark.parametrize("key,value,message", [
    ("feature_map", "gelu", "feature_map must be one of elu1, relu, softmax, cos1, hedgehog, got 'gelu'"),
    ("linear_rope", "yes", "linear_rope must be true or false, got 'yes'"),
    ("attention", "flash", "attention must be one of softmax, linear, hybrid, got 'flash'"),
], ids=["feature_map", "linear_rope", "attention"])
def test_bad_engine_keys_name_key_and_file(tmp_path, key, value, message):
    path = write(tmp_path, {**BASE, key: value})
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_json(path)
    print(e.value)
    assert str(e.value) == f"{path}: {message}"
