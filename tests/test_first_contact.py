"""What a new user meets first (issue 34): tracebacks, silent acceptance, chat defaults, habits."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from engine.api import load


def gen(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_line_error(r, *words, code=2):
    print(repr(r.stderr))
    assert r.exit_code == code and "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gen: error: ")
    for w in words:
        assert w in lines[0]
    return lines[0]


# ---------------------------------------------------------------------- item 3: tracebacks
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantized_torch_step_in_a_16_bit_dtype(small_model_dir, dtype):
    """--backend torch --quantize q8_0 --dtype bfloat16 (the README's "every choice explicit" line) runs,
    and its torch step agrees with the module path on the same quantized weights."""
    prompt = "the cat sat"
    got = load(str(small_model_dir), backend="torch", quantize="q8_0", dtype=dtype).generate(
        prompt, temperature=0, max_new_tokens=8)
    ref = load(str(small_model_dir), backend="module", quantize="q8_0", dtype=dtype).generate(
        prompt, temperature=0, max_new_tokens=8)
    assert got.stats.step_form == "torch" and got.ids == ref.ids
    r = gen("--model", small_model_dir, "--backend", "torch", "--quantize", "q8_0", "--dtype", dtype,
            "--max-new-tokens", 4, prompt)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
