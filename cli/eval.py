"""`gen eval`: perplexity, nats/token and bits per byte of a model over a corpus file."""
from __future__ import annotations

import json

import click

from cli.common import FEATURE_MAP_HELP, run_guarded
from engine.attention.hybrid import runtime_config
from engine.evaluate import evaluate_file
from engine.loader import load_model
from engine.quant import quantize_model
from engine.threads import set_threads


@click.command("eval")
@click.option("--model", "model_name", default="tiny", show_default=True, help="registered name or path")
@click.option("--attention", type=click.Choice(["softmax", "linear", "hybrid"]), help="default: the model's own")
@click.option("--softmax-layers", help="hybrid: layers that keep a KV cache, e.g. 2,9,11, or auto:K")
@click.option("--window", type=int, help="linear layers also attend exactly to the last W keys")
@click.option("--feature-map", help=FEATURE_MAP_HELP)
@click.option("--data", required=True, type=click.Path(dir_okay=False),
              help="documents separated by '<|endoftext|>' lines")
@click.option("--context", type=int, help="window length in tokens (default: max_position_embeddings)")
@click.option("--max-docs", type=int, help="score only the first N documents (default: all)")
@click.option("--batch-size", default=8, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--quantize", type=click.Choice(["q8_0", "q4_0", "q4_1"]),
              help="quantize the matrices at load (a GGUF's own Q8_0/Q4_0/Q4_1 blocks are kept as they are); "
                   "scored on the dequantized weights")
@click.option("--threads", type=int, help="CPU threads (default: torch's, all cores: scoring is batched matmuls)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def eval_cmd(model_name, attention, softmax_layers, window, feature_map, data, context, max_docs, batch_size, device, dtype,
             quantize, threads, as_json):
    """Score each document as BOS + text + EOS; bits per byte is the headline."""
    def run():
        if threads is not None:
            set_threads(threads)
        model, tokenizer = load_model(model_name, device=device, dtype=dtype,
                                      configure=lambda cfg: runtime_config(cfg, attention, softmax_layers, window))
        if quantize:
            quantize_model(model, quantize)
        res = evaluate_file(model, tokenizer, data, attention=model.config.attention, feature_map=feature_map,
                            context=context, batch_size=batch_size, progress=not as_json, max_docs=max_docs)
        if as_json:
            click.echo(json.dumps({"model": str(model_name), "data": data, **res.to_dict()}))
        else:
            click.echo(f"{res.attention}: {res.bits_per_byte:.4f} bits/byte, {res.nats_per_token:.4f} nats/token, "
                       f"perplexity {res.perplexity:.3f} ({res.documents} documents, {res.tokens} tokens, "
                       f"{res.bytes} bytes, context {res.context})")
    run_guarded(run)
