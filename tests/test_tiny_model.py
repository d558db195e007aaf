"""The shipped weights/tiny: loads, runs both paths, tokenizer round-trips, greedy output is stable.

The golden file is written by the engine itself, never by hand:
    python tests/test_tiny_model.py --update
"""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "weights" / "tiny"
GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_greedy.json"
PROMPT = "Once upon a time"
N_NEW = 20

pytestmark = pytest.mark.skipif(not (TINY / "model.safetensors").exists(), reason="weights/tiny not present")


def greedy_ids(model, tokenizer, attention: str, n: int = N_NEW) -> list[int]:
    """Greedy continuation straight over step(): prefill the prompt, then one token at a time."""
    prompt = torch.tensor([tokenizer.encode(PROMPT, bos=True)])
    state = model.init_state(1, prompt.shape[1] + n, attention)
    logits = model.step(prompt, state, last_only=True)
    out = []
    for _ in range(n):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(nxt))
        logits = model.step(nxt, state)
    return out


@pytest.fixture(scope="module")
def tiny():
    from engine.loader import load_model
    return load_model("tiny", dtype="float32")


def test_config_matches_tokenizer_and_both_paths(tiny):
    model, tok = tiny
    cfg = model.config
    assert set(cfg.trained_for) == {"softmax", "linear"}
    assert tok.bos_id == cfg.bos_token_id and tok.eos_id in cfg.eos_ids and tok.vocab_size == cfg.vocab_size
    size = sum(f.stat().st_size for f in TINY.iterdir())
    assert size < 25 * 2**20, f"weights/tiny is {size} bytes"


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_both_paths_run(tiny, path):
    model, tok = tiny
    ids = torch.tensor([tok.encode(PROMPT, bos=True)])
    state = model.init_state(1, 32, path)
    logits = model.step(ids, state)
    assert torch.isfinite(logits).all() and logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_tokenizer_round_trips(tiny):
    _, tok = tiny
    for text in ["Once upon a time, there was a little girl named Lily.",
                 "\"Hi!\" said Tom.\n\nThey played all day.", "Zoë ate 12 crème brûlées 🙂 — 你好"]:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_golden_greedy_continuation(tiny, path):
    model, tok = tiny
    golden = json.loads(GOLDEN.read_text())
    got = greedy_ids(model, tok, path)
    print(path, got, repr(tok.decode(got)))
    assert got == golden[path]["ids"], f"{path}: greedy continuation changed: {tok.decode(got)!r}"


if __name__ == "__main__" and "--update" in sys.argv:
    sys.path.insert(0, str(ROOT))
    from engine.loader import load_model
    model, tok = load_model("tiny", dtype="float32")
    data = {"prompt": PROMPT, "new_tokens": N_NEW}
    for p in ("softmax", "linear"):
        ids = greedy_ids(model, tok, p)
        data[p] = {"ids": ids, "text": tok.decode(ids)}
    GOLDEN.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(data, indent=2, ensure_ascii=False))
