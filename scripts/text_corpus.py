#!/usr/bin/env python3
"""Plain-text corpora the project can rebuild on a fresh machine (Debian packages), as documents
separated by `<|endoftext|>` lines (the format `gen eval`, `gen train` and `gen linearize` read).

    apt-get install -y python3.11-doc fortunes
    python scripts/text_corpus.py html /usr/share/doc/python3.11/html > python-docs.txt
    python scripts/text_corpus.py fortunes /usr/share/games/fortunes/{literature,people,...} > fortunes.txt
    python scripts/text_corpus.py fortunes FILE... --exclude FILE...    # minus every fortune of the --exclude files
    apt-get install -y debian-handbook
    python scripts/text_corpus.py html /usr/share/doc/debian-handbook/html/en-US > handbook.txt
    pip download --no-deps chatterbot-corpus==1.3.3 && unzip chatterbot_corpus-*.whl
    python scripts/text_corpus.py dialogue chatterbot_corpus/data/english > dialogue.txt
    cat fortunes-train.txt handbook.txt dialogue.txt > everyday.txt   # the linearize stages of 2026-11-27's second loan

html: one document per page, the text of the page's main body (the standard library's
html.parser; scripts, styles, navigation, headers and footers dropped), pages in sorted path
order. fortunes: fortunes (the files' '%' lines separate them) joined into documents of about
1,000 characters; `--exclude` drops every fortune that also occurs (ignoring case, spacing and
punctuation) in the files after it: a training text held apart from an evaluation text. dialogue: the
conversations of chatterbot-corpus YAML files (`conversations: [[line, reply, ...], ...]`) as
alternating "A:"/"B:" lines, joined into documents of about 1,000 characters.
"""
from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

SEP = "<|endoftext|>"
SKIP = {"script", "style", "nav", "header", "footer", "head"}
BLOCK = {"p", "div", "section", "li", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "dt", "dd", "tr", "br", "table"}


class MainText(HTMLParser):
    """Text inside <div role="main"> (Sphinx's body), or the whole <body> when there is none."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.main_depth = 0     # >0 inside the main div
        self.depth = 0          # open <div>s
        self.has_main = False

    def handle_starttag(self, tag, attrs):
        self.depth += tag == "div"     # only divs are counted: void tags (<br>, <img>) have no end tag
        a = dict(attrs)
        if tag == "div" and a.get("role") == "main" and not self.main_depth:
            self.main_depth = self.depth
        if tag in SKIP:
            self.skip += 1
        if tag in BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in SKIP and self.skip:
            self.skip -= 1
        if tag == "div":
            if self.main_depth and self.depth == self.main_depth:
                self.main_depth = 0
            self.depth -= 1
        if tag in BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip and (self.main_depth or not self.has_main):
            self.parts.append(data)


def html_text(path: Path) -> str:
    html = path.read_text(encoding="utf-8", errors="replace")
    p = MainText()
    p.has_main = 'role="main"' in html     # then only the main div's text counts
    p.feed(html)
    text = "".join(p.parts).replace("¶", "")
    lines = [re.sub(r"[ \t]+", " ", ln).strip() for ln in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def html_docs(root: Path):
    for path in sorted(root.rglob("*.html")):
        if "_static" in path.parts or "_sources" in path.parts:
            continue
        text = html_text(path)
        if len(text) >= 200:
            yield text


def fortunes(f):
    for item in Path(f).read_text(encoding="utf-8", errors="replace").split("\n%\n"):
        item = item.strip().strip("%").strip()
        if item:
            yield item


def _key(text: str) -> str:   # a fortune compared without case, spacing or punctuation
    return re.sub(r"[^a-z0-9]+", "", text.lower())


def joined(items, size: int = 1000):
    """Items packed into documents of about `size` characters (blank lines between them)."""
    buf = ""
    for item in items:
        buf = f"{buf}\n\n{item}" if buf else item
        if len(buf) >= size:
            yield buf
            buf = ""
    if buf:
        yield buf


def fortune_docs(files, exclude=()):
    held_out = {_key(item) for f in exclude for item in fortunes(f)}
    return joined(item for f in files for item in fortunes(f) if _key(item) not in held_out)


def conversations(root: Path):
    import yaml     # PyYAML: a dependency of the eval extra (lm-eval)

    for path in sorted(root.rglob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conv in data.get("conversations") or []:
            lines = [str(x).strip() for x in conv if str(x).strip()]
            if len(lines) >= 2:
                yield "\n".join(f"{'AB'[i % 2]}: {line}" for i, line in enumerate(lines))


def dialogue_docs(root: Path):
    return joined(conversations(root))


def main(argv):
    if len(argv) < 2 or argv[0] not in ("html", "fortunes", "dialogue"):
        sys.exit("usage: text_corpus.py html DIR | fortunes FILE... | dialogue DIR")
    if argv[0] == "html":
        docs = html_docs(Path(argv[1]))
    elif argv[0] == "dialogue":
        docs = dialogue_docs(Path(argv[1]))
    else:
        files = argv[1:]
        cut = files.index("--exclude") if "--exclude" in files else len(files)
        docs = fortune_docs(files[:cut], files[cut + 1:])
    out = sys.stdout
    for doc in docs:
        out.write(doc.replace(SEP, "") + f"\n{SEP}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
