"""`gen serve`: an OpenAI-compatible HTTP server (see engine/serve and README 'Serving')."""
from __future__ import annotations

import click

from cli.common import (backend_option, dtype_options, activations_option, device_option, fail, prefill_chunk_option, run_guarded,
                        run_options, threads_option)
from cli.open_page import open_when_ready, page_url
from engine.serve import PREFILL_SHARE, Policy, open_server, run
from engine.serve.guard import (DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_BODY, DEFAULT_MAX_CONNECTIONS, host_name,
                                DEFAULT_READ_TIMEOUT_S, LOOPBACK)
from engine.serve.connections import check_listen
from engine.serve.server import DEFAULT_QUEUE_TIMEOUT_S
from engine.serve.shutdown import DEFAULT_GRACE_S

ANY_ADDRESS = ("0.0.0.0", "::", "")


@click.command("serve", short_help="Serve a model over the OpenAI API, with a side-by-side page.")
@click.option("-m", "--model", "model_name", default="tiny", show_default=True,
              help="registered name or path; also the name clients send as `model`")
@click.option("--served-model-name", "served_names", multiple=True, metavar="NAME",
              help="the name clients send as `model` and responses carry (repeatable: the first is reported, "
                   "all are accepted; default: --model's value). A request without `model` gets the served model")
@run_options("the default run, default: the model's own; a request may pick its own attention, "
             "softmax_layers and window, resolved as these options are")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind (loopback by default)")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--max-batch", default=16, show_default=True, type=int, help="sequences decoded at once")
@click.option("--max-queue", type=int, help="requests waiting for a row beyond those (default 4 x max-batch); "
                                            "more get 429 with Retry-After")
@click.option("--max-context", type=int, help="softmax tokens per sequence, prompt included "
                                               "(default: the model's max_position_embeddings)")
@dtype_options
@device_option
@backend_option
@threads_option()
@click.option("--max-prompt", type=int, help="prompt tokens per request on every path, else 400 "
                                              "context_length_exceeded (default: --max-context; 0 = no limit)")
@click.option("--max-tokens-cap", type=int,
              help="tokens a request may generate; a larger max_tokens is clamped (finish_reason length). "
                   "Default: the context on softmax/hybrid, 4096 on linear; 0 = no cap")
@click.option("--queue-timeout", type=float, default=DEFAULT_QUEUE_TIMEOUT_S, show_default=True,
              help="seconds a request may wait for a row, then 503 with Retry-After (0 = no limit)")
@click.option("--max-body", type=int, default=DEFAULT_MAX_BODY, show_default=True,
              help="bytes a request body may hold, else 413 (0 = no limit)")
@click.option("--max-connections", type=int,
              help=f"connections held at once; one more gets 503 and is closed (default: {DEFAULT_MAX_CONNECTIONS}, "
                   "or half the open-file limit, ulimit -n, when that is lower; 0 = no limit)")
@click.option("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, show_default=True,
              help="seconds a client has to send a request's headers, and between the parts of its body, "
                   "which past its first such seconds must average 500 bytes/s (else the connection closes; a "
                   "stalled or trickling body gets 408); 0 = none")
@click.option("--timeout-keep-alive", type=float, default=DEFAULT_KEEP_ALIVE_S, show_default=True,
              help="seconds an idle connection is kept open between requests")
@click.option("--shutdown-grace", type=float, default=DEFAULT_GRACE_S, show_default=True,
              help="on SIGTERM/SIGINT: seconds running requests may take to finish (new ones get 503); "
                   "then open streams end with an error event and [DONE]; a second signal exits at once")
@click.option("--api-key", envvar="GEN_API_KEY", help="require `Authorization: Bearer KEY` on every route but "
                                                       "/health (default: $GEN_API_KEY; none: no key asked)")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="also answer requests whose Host header names NAME (repeatable; '*' any; default: "
                   "localhost, 127.0.0.1, [::1] and the --host address)")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="let web pages from ORIGIN (e.g. http://localhost:3000; '*' any) call the server; repeatable "
                   "(default: CORS off, foreign Origins refused)")
@click.option("--docs", is_flag=True, help="serve /docs, /redoc and /openapi.json (off by default)")
@prefill_chunk_option
@click.option("--prefill-share", type=float, default=PREFILL_SHARE, show_default=True,
              help="while sequences decode, prompts are fed in pieces for about this many decode steps' time "
                   "between two steps: a stream's gaps stay ~(1 + share) steps, a prompt prefills at ~share / "
                   "(1 + share) of its speed alone")
@activations_option
@click.option("--open", "open_page", is_flag=True, help="open the comparison page (/) in the browser once the "
                                                        "server answers")
def serve_cmd(model_name, attention, softmax_layers, window, feature_map, host, port, max_batch, max_queue,
              max_context, dtype, kv_dtype, device, backend, threads, max_prompt, queue_timeout, max_body, api_key,
              allow_hosts, cors_origins, docs, prefill_chunk, max_tokens_cap, max_connections, read_timeout,
              timeout_keep_alive, shutdown_grace, served_names, activations, prefill_share=PREFILL_SHARE,
              open_page=False, sparse_keys=None):
    """Serve MODEL over HTTP: /v1/models, /v1/completions, /v1/chat/completions (OpenAI format, SSE streams),
    and a page at / comparing attention configurations side by side."""
    if max_batch < 1:
        fail(f"--max-batch must be >= 1, got {max_batch}")
    if max_queue is not None and max_queue < 0:
        fail(f"--max-queue must be >= 0, got {max_queue}")
    if max_context is not None and max_context < 2:
        fail(f"--max-context must be >= 2, got {max_context}")
    if max_prompt is not None and max_prompt < 0:
        fail(f"--max-prompt must be >= 0 (0 = no limit), got {max_prompt}")
    if max_tokens_cap is not None and max_tokens_cap < 0:
        fail(f"--max-tokens-cap must be >= 0 (0 = no cap), got {max_tokens_cap}")
    if not queue_timeout >= 0 or queue_timeout == float("inf"):
        fail(f"--queue-timeout must be a number of seconds >= 0 (0 = no limit), got {queue_timeout}")
    if max_body < 0:
        fail(f"--max-body must be >= 0 bytes (0 = no limit), got {max_body}")
    if max_connections is None:
        max_connections = default_max_connections()
    if max_connections < 0:
        fail(f"--max-connections must be >= 0 (0 = no limit), got {max_connections}")
    if not 0 <= read_timeout < float("inf"):
        fail(f"--read-timeout must be a number of seconds >= 0 (0 = none), got {read_timeout}")
    if not 0 < timeout_keep_alive < float("inf"):
        fail(f"--timeout-keep-alive must be a number of seconds > 0, got {timeout_keep_alive}")
    if not 0 <= shutdown_grace < float("inf"):
        fail(f"--shutdown-grace must be a number of seconds >= 0, got {shutdown_grace}")
    if api_key is not None and not api_key.strip():
        fail("--api-key must not be empty (leave it out to ask for no key)")
    if api_key is not None and (api_key != api_key.strip() or not api_key.isascii() or not api_key.isprintable()):
        fail("--api-key must be printable ASCII without spaces around it: clients send it in an HTTP header, "
             "where no other key could ever match")
    if any(not n.strip() for n in served_names):
        fail("--served-model-name takes a non-empty name")
    if any(not h.strip() for h in allow_hosts) or any(not o.strip() for o in cors_origins):
        fail("--allow-host and --cors-origin take a non-empty name")
    for name in allow_hosts:
        if not host_name(name):
            fail(f"--allow-host {name}: not a host name; give a name (my.box), name:port, *.domain or *")
    if not 0 < port < 65536:
        fail(f"--port must be in 1..65535, got {port}")
    if not 0 <= prefill_share < float("inf"):
        fail(f"--prefill-share must be a number >= 0 (decode steps' time), got {prefill_share}")
    hosts = LOOPBACK + tuple(allow_hosts) + ((host,) if host not in ANY_ADDRESS else ())
    policy = Policy(api_key=api_key, allow_hosts=hosts, cors_origins=cors_origins, docs=docs, max_body=max_body,
                    max_connections=max_connections, read_timeout=read_timeout, keep_alive=timeout_keep_alive)
    if host in ANY_ADDRESS and not allow_hosts:
        click.echo(f"gen serve: listening on every address, but only requests whose Host is {', '.join(LOOPBACK)} "
                   "are answered: add --allow-host NAME (or '*')", err=True)
    run_guarded(lambda: check_listen(host, port))   # before the model loads: its port taken is one line now
    server = run_guarded(lambda: open_server(model_name, attention, feature_map, dtype, backend, threads,
                                             max_batch, max_context, max_queue, softmax_layers, window,
                                             kv_dtype, max_prompt=max_prompt, queue_timeout=queue_timeout,
                                             prefill_chunk=prefill_chunk, activations=activations,
                                             max_tokens_cap=max_tokens_cap,
                                             aliases=served_names, device=device,
                                             prefill_share=prefill_share, sparse_keys=sparse_keys))
    if open_page:
        open_when_ready(page_url(host, port))
    run_guarded(lambda: run(server, host=host, port=port, policy=policy, grace=shutdown_grace))


def default_max_connections() -> int:
    """DEFAULT_MAX_CONNECTIONS, or half the process's open-file limit when that is lower (the model's
    files, the native pool and the log need the rest)."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return DEFAULT_MAX_CONNECTIONS
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(1, min(DEFAULT_MAX_CONNECTIONS, soft // 2))
