#!/usr/bin/env python3
"""The extra evaluation texts of weights/smollm2-linear/README.md, rebuilt from files on the machine.

    python scripts/eval_texts.py long ../shared/data/tinystories/valid.txt > long-stories.txt
    python scripts/eval_texts.py long general.txt > long-general.txt      # general.txt: see the card
    python scripts/eval_texts.py legal > legal.txt                         # Debian's base-files licences

long: 8 documents, each the next 8 documents of the input joined by blank lines (the first 64):
contexts of ~1.5k-2.7k tokens, where a 256-key window covers a small part of each document.
legal: the licence texts of /usr/share/common-licenses (GPL-3, Apache-2.0, MPL-2.0, GFDL-1.3, LGPL-3,
Artistic, CC0-1.0, GPL-2), whitespace-normalised paragraphs joined into documents of just over 1,200
characters, every n-th of them so that 40 are left: an English no training file of the card holds.
Documents are separated by `<|endoftext|>` lines, as `gen eval` reads them.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from models.corpus import read_documents

SEP = "\n<|endoftext|>\n"
LICENCES = ["GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "LGPL-3", "Artistic", "CC0-1.0", "GPL-2"]


def long_documents(path: str, groups: int = 8, per: int = 8) -> list[str]:
    docs = read_documents(path)
    return ["\n\n".join(docs[i:i + per]) for i in range(0, groups * per, per)]


def legal_documents(root: str = "/usr/share/common-licenses", count: int = 40, size: int = 1200) -> list[str]:
    docs = []
    for name in LICENCES:
        text = Path(root, name).read_text(encoding="utf-8", errors="replace")
        cur = ""
        for para in (re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)):
            if para:
                cur = f"{cur}\n\n{para}" if cur else para
                if len(cur) > size:
                    docs.append(cur)
                    cur = ""
    return docs[::max(1, len(docs) // count)][:count]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "long":
        docs = long_documents(sys.argv[2])
    elif len(sys.argv) == 2 and sys.argv[1] == "legal":
        docs = legal_documents()
    else:
        print("usage: eval_texts.py long FILE | eval_texts.py legal", file=sys.stderr)
        sys.exit(2)
    sys.stdout.write(SEP.join(docs) + "\n")


if __name__ == "__main__":
    main()
