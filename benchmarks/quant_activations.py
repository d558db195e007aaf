"""What quantized weights should multiply in the native step: fp32 activations or q8-rounded ones.

    python benchmarks/quant_activations.py --model smollm2 --data ../shared/data/tinystories/valid.txt --docs 20

For each form (the native step with --activations f32, with q8, and the PyTorch step as the
reference: dequantized blocks times fp32 activations), on the same weights: the perplexity of the
first --docs documents (BOS + text + EOS, teacher-forced one token at a time through that very step,
so the decode arithmetic is what is scored, not the module path `gen eval` uses), decode ms/token
(the median of those steps), and the greedy answer to the README's chat question. Prints a table;
--json writes the records.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from engine import load
from models.corpus import read_documents

QUESTION = "What is the capital of France?"
# a small factual check (greedy, 24 tokens; right when the answer holds the expected word)
QA = [("What is the capital of France?", "paris"), ("What is the capital of Italy?", "rome"),
      ("What is the capital of Japan?", "tokyo"), ("What is the capital of Germany?", "berlin"),
      ("What is the capital of Spain?", "madrid"), ("What is 2 + 2?", "4"),
      ("What color is the sky on a clear day?", "blue"), ("How many days are in a week?", "7"),
      ("What is the largest planet in the solar system?", "jupiter"), ("Who wrote Romeo and Juliet?", "shakespeare"),
      ("What is the boiling point of water in Celsius?", "100"), ("What gas do plants absorb from the air?", "carbon"),
      ("How many legs does a spider have?", "8"), ("What is the capital of Canada?", "ottawa"),
      ("What is the chemical symbol for gold?", "au"), ("What is the freezing point of water in Celsius?", "0")]
WORDS = {"eight": "8", "seven": "7", "four": "4"}


def questions_right(llm) -> int:
    right = 0
    for q, a in QA:
        ans = "".join(llm.chat([{"role": "user", "content": q}], temperature=0, max_new_tokens=24)).lower()
        for word, digit in WORDS.items():
            ans = ans.replace(word, digit)
        right += a in ans
    return right


def score(llm, docs: list[str], max_tokens: int) -> tuple[float, float, int]:
    """(perplexity, median ms per step, tokens) of `docs` stepped one token at a time through llm.step."""
    model, step = llm.model, llm.step
    nll, n, times = 0.0, 0, []
    eos = model.config.eos_ids[0]
    with torch.inference_mode():
        for doc in docs:
            ids = llm.tokenizer.encode(doc, bos=True)[:max_tokens] + [eos]
            state = model.init_state(1, len(ids) + 1, llm.attention)
            for t in range(len(ids) - 1):
                t0 = time.perf_counter()
                logits = step(torch.tensor([[ids[t]]]), state)[0, -1].float()
                times.append(time.perf_counter() - t0)
                nll -= torch.log_softmax(logits, -1)[ids[t + 1]].item()
                n += 1
    return math.exp(nll / n), 1e3 * statistics.median(times), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", required=True, action="append", help="documents separated by <|endoftext|> lines")
    ap.add_argument("--docs", type=int, default=20, help="documents of each --data file")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens scored per document at most")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    forms = [("native", "f32"), ("native", "q8"), ("native", "f32-prompt"), ("torch", "f32")]
    records = []
    print("| step | activations | data | perplexity | tokens | decode ms/token | greedy answer | questions right |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- | ---: |")
    for backend, acts in forms:
        llm = load(a.model, backend=backend, activations=acts, threads=a.threads)
        answer = "".join(llm.chat([{"role": "user", "content": QUESTION}], temperature=0, max_new_tokens=12))
        answer = answer.strip().replace("\n", " ")
        right = questions_right(llm)
        for path in a.data:
            docs = read_documents(path)[:a.docs]
            ppl, ms, n = score(llm, docs, a.max_tokens)
            rec = {"step": backend, "activations": acts, "data": path, "perplexity": ppl, "tokens": n,
                   "decode_ms_per_token": ms, "answer": answer, "questions_right": right, "questions": len(QA),
                   "form_ran": llm.step.last_form}
            records.append(rec)
            print(f"| {llm.step.last_form} | {acts} | {path} | {ppl:.3f} | {n} | {ms:.2f} | {answer[:40]} | "
                  f"{right}/{len(QA)} |", flush=True)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"model": a.model, "records": records}, f, indent=1)



if __name__ == "__main__":
    main()
