"""scripts/text_corpus.py: the corpora `gen linearize` trains on, rebuilt on a fresh machine."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("text_corpus", ROOT / "scripts" / "text_corpus.py")
corpus = importlib.util.module_from_spec(spec)
spec.loader.exec_module(corpus)


def test_items_are_packed_into_documents_of_about_the_size():
    docs = list(corpus.joined(["a" * 400, "b" * 400, "c" * 400, "d" * 10], size=1000))
    assert docs == ["a" * 400 + "\n\n" + "b" * 400 + "\n\n" + "c" * 400, "d" * 10]


def test_fortunes_of_the_excluded_files_are_left_out(tmp_path):
    train, held = tmp_path / "train", tmp_path / "held"
    train.write_text("A stitch in time.\n%\nSaves nine!\n%\nLook before you leap.\n")
    held.write_text("saves   NINE\n%\n")
    assert list(corpus.fortune_docs([train], [held])) == ["A stitch in time.\n\nLook before you leap."]


def test_chatterbot_conversations_become_alternating_lines(tmp_path):
    pytest.importorskip("yaml", reason="PyYAML (the eval extra) reads chatterbot-corpus files")
    (tmp_path / "greetings.yml").write_text(
        "categories: [greetings]\nconversations:\n- - Hello\n  - Hi there\n  - How are you?\n- - lonely line\n")
    assert list(corpus.dialogue_docs(tmp_path)) == ["A: Hello\nB: Hi there\nA: How are you?"]
