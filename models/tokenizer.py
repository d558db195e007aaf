"""SentencePiece tokenizer: load, encode documents, and train a new one on a corpus."""
from __future__ import annotations

import os
import tempfile

from models.errors import CheckpointError


class Tokenizer:
    def __init__(self, path: str | os.PathLike):
        import sentencepiece as spm
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such tokenizer file")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:
            raise CheckpointError(f"{path}: not a SentencePiece model ({str(e).splitlines()[0]})") from None
        self.path = path
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        self.vocab_size = self.sp.vocab_size()

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def byte_value(self, token_id: int) -> int | None:
        """The byte a byte-fallback piece (<0xNN>) stands for; None for every other piece."""
        table = getattr(self, "_byte_table", None)
        if table is None:
            sp = self.sp
            table = self._byte_table = {i: int(sp.id_to_piece(i)[3:5], 16)
                                        for i in range(self.vocab_size) if sp.is_byte(i)}
        return table.get(int(token_id))

    def decode_continuation(self, ids) -> str:
        """The text `ids` add after whatever precedes them: like `decode`, but the first token's
        leading space is kept (SentencePiece drops it at the start of a text, which would glue
        the first generated word to the prompt). decode(a + b) == decode(a) + decode_continuation(b)
        whenever `a` ends on a whole character.
        """
        anchor_id, anchor_text = self._anchor()
        text = self.sp.decode([anchor_id] + [int(i) for i in ids])
        return text[len(anchor_text):] if text.startswith(anchor_text) else self.decode(ids)

    def _anchor(self) -> tuple[int, str]:
        """A plain piece (no space, not a byte or control piece) that decodes to itself."""
        if getattr(self, "_anchor_cache", None) is None:
            sp = self.sp
            for i in range(self.vocab_size):
                if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i):
                    continue
                piece = sp.id_to_piece(i)
                if piece and "\u2581" not in piece and sp.decode([i]) == piece:
                    self._anchor_cache = (i, piece)
                    break
            else:
                raise CheckpointError(f"{self.path}: no plain piece to anchor decoding; the vocabulary is all "
                                      f"byte, control or space pieces")
        return self._anchor_cache


def train_tokenizer(docs: list[str], out_path: str, vocab_size: int, model_type: str = "bpe",
                    seed_sentences: int = 2_000_000) -> Tokenizer:
    """Train SentencePiece on documents; writes `out_path` (a .model file)."""
    import sentencepiece as spm
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "corpus.txt")
        with open(text, "w", encoding="utf-8") as f:
            for doc in docs:
                for line in doc.splitlines():
                    if line.strip():
                        f.write(line.strip() + "\n")
        prefix = os.path.join(tmp, "tok")
        spm.SentencePieceTrainer.train(
            input=text, model_prefix=prefix, vocab_size=vocab_size, model_type=model_type,
            byte_fallback=True, character_coverage=1.0, split_digits=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, input_sentence_size=seed_sentences,
            shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2,
            allow_whitespace_only_pieces=True, add_dummy_prefix=False)
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        os.replace(prefix + ".model", out_path)
    return Tokenizer(out_path)


def check_vocab(tokenizer, cfg, where) -> None:
    """A tokenizer whose ids run past the model's embedding rows (cfg: a models.config.ModelConfig) would
    index out of range: refuse it."""
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                              f"vocab_size is {cfg.vocab_size}; this tokenizer belongs to another model")
