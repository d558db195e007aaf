"""`gen serve`: an OpenAI-compatible HTTP server (see engine/serve and README 'Serving')."""
from __future__ import annotations

import click

from cli.common import FEATURE_MAP_HELP, KV_DTYPE_HELP, fail, run_guarded
from cli.open_page import open_when_ready, page_url
from engine.serve import open_server, run


@click.command("serve")
@click.option("--model", "model_name", default="tiny", show_default=True,
              help="registered name or path; also the name clients send as `model`")
@click.option("--attention", type=click.Choice(["softmax", "linear", "hybrid"]),
              help="default path (default: the model's own); requests may pick another with `attention`")
@click.option("--softmax-layers", help="hybrid: layers that keep a KV cache, e.g. 2,9,11, or auto:K")
@click.option("--window", type=int, help="linear layers also attend exactly to the last W keys")
@click.option("--feature-map", help=FEATURE_MAP_HELP)
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind (loopback by default)")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--max-batch", default=16, show_default=True, type=int, help="sequences decoded at once")
@click.option("--max-queue", type=int, help="requests waiting for a row beyond those (default 4 x max-batch); "
                                            "more get 429 with Retry-After")
@click.option("--max-context", type=int, help="softmax tokens per sequence, prompt included "
                                               "(default: the model's max_position_embeddings)")
@click.option("--dtype", help="float32 (default), bfloat16, float16")
@click.option("--kv-dtype", help=KV_DTYPE_HELP)
@click.option("--backend", type=click.Choice(["auto", "torch", "native", "module"]), default="auto",
              show_default=True, help="decode step form: auto = the C step where it applies, else PyTorch")
@click.option("--threads", type=int, help="CPU threads (default: 1)")
@click.option("--open", "open_page", is_flag=True, help="open the comparison page (/) in the browser once the "
                                                        "server answers")
def serve_cmd(model_name, attention, softmax_layers, window, feature_map, host, port, max_batch, max_queue,
              max_context, dtype, kv_dtype, backend, threads, open_page=False):
    """Serve MODEL over HTTP: /v1/models, /v1/completions, /v1/chat/completions (OpenAI format, SSE streams),
    and a page at / comparing attention configurations side by side."""
    if max_batch < 1:
        fail(f"--max-batch must be >= 1, got {max_batch}")
    if max_context is not None and max_context < 2:
        fail(f"--max-context must be >= 2, got {max_context}")
    if not 0 < port < 65536:
        fail(f"--port must be in 1..65535, got {port}")
    server = run_guarded(lambda: open_server(model_name, attention, feature_map, dtype, backend, threads,
                                             max_batch, max_context, max_queue, softmax_layers, window,
                                             kv_dtype))
    if open_page:
        open_when_ready(page_url(host, port))
    run_guarded(lambda: run(server, host=host, port=port))
