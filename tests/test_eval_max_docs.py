"""gen eval --max-docs: scores only the first N documents (the SmolLM2 reference is 30 documents at 256 tokens)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from conftest import generated_sentences


def test_max_docs_scores_the_first_documents(small_model_dir, tmp_path):
    docs = [" ".join(generated_sentences(3, seed=i)) for i in range(6)]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n<|endoftext|>\n".join(docs) + "\n")
    first3 = tmp_path / "first3.txt"
    first3.write_text("\n<|endoftext|>\n".join(docs[:3]) + "\n")

    def run(path, *extra):
        r = CliRunner().invoke(main, ["eval", "--model", str(small_model_dir), "--data", str(path), "--json",
                                      "--context", "32", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)
    some, ref, whole = run(corpus, "--max-docs", "3"), run(first3), run(corpus)
    assert some["documents"] == 3 and whole["documents"] == 6
    assert (some["tokens"], some["bytes"]) == (ref["tokens"], ref["bytes"])
    assert some["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-6)
    r = CliRunner().invoke(main, ["eval", "--model", str(small_model_dir), "--data", str(corpus), "--max-docs", "0"])
    assert r.exit_code == 2 and "--max-docs must be at least 1, got 0" in r.output
