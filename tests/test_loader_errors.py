"""Bad checkpoints: every case is one line naming the file and the problem."""
import json
import struct

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from cli.main import main as gen
from engine.errors import CheckpointError, ConfigError
from models.llama2c import export_llama2c
from engine.loader import load_model
from models.weights import save_pretrained
from tests.conftest import tiny_model
from tests.test_loaders import shard

LAYER = "model.layers.1"


def hf_dir(tmp_path, **overrides):
    d = tmp_path / "model"
    save_pretrained(tiny_model(seed=1, num_key_value_heads=2, **overrides), d, dtype=torch.float32)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d, fn):
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors")


def no_config(tmp_path):
    d = hf_dir(tmp_path)
    (d / "config.json").unlink()
    return d, ConfigError, ["config.json"]


def unsupported_model_type(tmp_path):
    d = hf_dir(tmp_path)
    edit_config(d, model_type="gpt_neox")
    return d, ConfigError, ["config.json", "unsupported model_type 'gpt_neox'",
                            "supported: llama, mistral, qwen2, qwen3"]


def truncated_safetensors(tmp_path):
    d = hf_dir(tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    return d, CheckpointError, ["model.safetensors", "truncated or corrupt"]


def corrupt_safetensors(tmp_path):
    d = hf_dir(tmp_path)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 64)
    return d, CheckpointError, ["model.safetensors", "truncated or corrupt"]


def missing_tensor(tmp_path):
    d = hf_dir(tmp_path)
    edit_tensors(d, lambda t: t.pop(f"{LAYER}.mlp.up_proj.weight"))
    return d, CheckpointError, ["model.safetensors", f"missing tensor {LAYER}.mlp.up_proj.weight"]


def missing_lm_head(tmp_path):      # config says untied, file has no lm_head
    d = hf_dir(tmp_path)
    edit_tensors(d, lambda t: t.pop("lm_head.weight"))
    return d, CheckpointError, ["missing tensor lm_head.weight"]


def wrong_shape(tmp_path):
    d = hf_dir(tmp_path)
    edit_tensors(d, lambda t: t.update({f"{LAYER}.self_attn.k_proj.weight": torch.zeros(64, 64)}))
    return d, CheckpointError, ["model.safetensors", f"tensor {LAYER}.self_attn.k_proj.weight",
                                "shape [64, 64], expected [32, 64]"]


def no_weights(tmp_path):
    d = hf_dir(tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    return d, CheckpointError, ["no model.safetensors", "pytorch_model.bin is not supported"]


def missing_shard(tmp_path):
    d = hf_dir(tmp_path)
    index = shard(d, 2)
    lost = sorted(set(index["weight_map"].values()))[1]
    (d / lost).unlink()
    return d, CheckpointError, ["model.safetensors.index.json", f"shard {lost}", "not found"]


def index_without_tensor(tmp_path):
    d = hf_dir(tmp_path)
    shard(d, 2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d, CheckpointError, ["model.safetensors.index.json", "missing tensor model.norm.weight"]


def llama2c_truncated(tmp_path):
    f = tmp_path / "m.bin"
    export_llama2c(tiny_model(seed=1, num_key_value_heads=2), f, version=0)
    f.write_bytes(f.read_bytes()[:-4])
    return f, CheckpointError, ["m.bin", "does not match its llama2.c header", "dim=64", "n_kv_heads=2"]


def llama2c_too_long(tmp_path):
    f = tmp_path / "m.bin"
    export_llama2c(tiny_model(seed=1), f, version=1)
    f.write_bytes(f.read_bytes() + b"\0" * 8)
    return f, CheckpointError, ["m.bin", "does not match its llama2.c header"]


def llama2c_quantized(tmp_path):
    f = tmp_path / "q8.bin"
    f.write_bytes(struct.pack("<Ii7iB", 0x616B3432, 2, 64, 96, 2, 4, 4, 97, 128, 1) + b"\0" * 300)
    return f, CheckpointError, ["q8.bin", "version 2", "not supported"]


def llama2c_absurd_header(tmp_path):   # a billion layers: rejected from the size, nothing built
    f = tmp_path / "big.bin"
    f.write_bytes(struct.pack("<7i", 64, 96, 10**9, 4, 2, 97, 128) + b"\0" * 1000)
    return f, CheckpointError, ["big.bin", "n_layers=1000000000", "does not match its llama2.c header"]


def not_a_checkpoint(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("these are not the weights you are looking for\n")
    return f, CheckpointError, ["notes.txt", "not a llama2.c checkpoint"]


def bare_safetensors_file(tmp_path):
    return hf_dir(tmp_path) / "model.safetensors", CheckpointError, ["directory holding config.json"]


CASES = [no_config, unsupported_model_type, truncated_safetensors, corrupt_safetensors, missing_tensor,
         missing_lm_head, wrong_shape, no_weights, missing_shard, index_without_tensor, llama2c_truncated,
         llama2c_too_long, llama2c_quantized, llama2c_absurd_header, not_a_checkpoint, bare_safetensors_file]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.replace("_", "-"))
def test_bad_checkpoint_gives_one_line_naming_file_and_problem(tmp_path, case):
    path, error, needles = case(tmp_path)
    with pytest.raises(error) as info:
        load_model(path)
    message = str(info.value)
    print(message)
    assert "\n" not in message
    assert str(path) in message or str(path.parent) in message
    for needle in needles:
        assert needle in message


def test_convert_cli_reports_a_bad_file_in_one_line(tmp_path):
    path, _, needles = llama2c_truncated(tmp_path)
    result = CliRunner().invoke(gen, ["convert", "llama2c", str(path), str(tmp_path / "out"), "--no-progress"])
    print(result.output)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gen: error: ") and needles[1] in lines[0]
