"""`gen serve`: an OpenAI-compatible HTTP server with continuous batching on either attention path.

    from engine.serve import Server, create_app, run
    server = Server(llm, name="tiny", max_batch=16, max_context=256)
    run(server, host="127.0.0.1", port=8000)       # SIGTERM/SIGINT drain it (engine.serve.shutdown)
    run(server, policy=Policy(api_key="s3cret"))   # who may call: engine.serve.guard

A leaf of the engine: nothing else in engine/ imports it.
"""
from __future__ import annotations

from engine.api import load
from engine.serve.app import create_app
from engine.serve.connections import uvicorn_config
from engine.serve.guard import Policy
from engine.serve.prefix_cache import PrefixCache
from engine.serve.scheduler import PREFILL_SHARE, Job, Scheduler
from engine.serve.server import Server
from engine.serve.shutdown import DEFAULT_GRACE_S, GracefulServer
from engine.steps import DEFAULT_ACTIVATIONS, DEFAULT_PREFILL_CHUNK


def open_server(model: str, attention: str | None = None, feature_map: str | None = None, dtype=None,
                backend: str = "auto", threads: int | None = None, max_batch: int = 16,
                max_context: int | None = None, max_queue: int | None = None, softmax_layers=None,
                window: int | None = None, kv_dtype=None, max_prompt: int | None = None, sparse_keys: int | None = None,
                queue_timeout: float | None = None, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                activations: str = DEFAULT_ACTIVATIONS,
                max_tokens_cap: int | None = None, aliases: tuple[str, ...] = (), device="cpu",
                prefill_share: float = PREFILL_SHARE) -> Server:
    """Load `model` (a registered name or a path) and wrap it in a Server named `model` (chat through
    the model's own chat template, when it has one: see `LLM.chat`).

    backend "auto": the native C step where it applies (it runs batches, each row's arithmetic
    the same whatever else is in the batch), else torch; the tests hold batched rows to their solo runs.
    attention/softmax_layers/window: the default configuration, as `load()` (hybrid layers, a sliding
    window and learned maps batch like the plain paths: their states regroup rows the same way).
    aliases: other names clients may send as `model` (the first of them, when given, is the name
    the server answers with). max_prompt / queue_timeout / max_tokens_cap: see Server (None: its
    defaults). prefill_chunk: see `load`; while sequences decode, the scheduler feeds prompts in pieces
    (a layer of such a block) for about `prefill_share` decode steps' time between steps. device: where the model, its states and the continuous batching run (cpu, cuda,
    cuda:N); the scheduler puts every tensor it makes on the model's device.
    """
    llm = load(model, attention=attention, feature_map=feature_map, device=device, dtype=dtype, backend=backend,
               threads=threads,
               softmax_layers=softmax_layers, window=window, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk,
               sparse_keys=sparse_keys,
               activations=activations)
    limits = {} if queue_timeout is None else {"queue_timeout": queue_timeout}
    names = tuple(aliases) or (str(model),)
    return Server(llm, name=names[0], aliases=names[1:], max_batch=max_batch, max_context=max_context,
                  max_queue=max_queue, max_prompt=max_prompt, max_tokens_cap=max_tokens_cap,
                  prefill_share=prefill_share, **limits)


def run(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
        policy: Policy | None = None, grace: float = DEFAULT_GRACE_S) -> None:
    """Serve until SIGTERM or SIGINT (Ctrl-C); prints the prefix cache's figures on the way out.
    policy: who may call (default Policy(): loopback Host names only, no key, no CORS, no docs).
    grace: seconds running requests may take to finish after the signal (engine.serve.shutdown)."""
    policy = policy if policy is not None else Policy()
    config = uvicorn_config(create_app(server, policy), policy, host=host, port=port, log_level=log_level)
    GracefulServer(config, server, grace=grace, on_exit=lambda: print_cache_stats(server)).run()


def print_cache_stats(server: Server) -> None:
    s = server.scheduler.cache.stats()
    print(f"prefix cache: {s['hits']} hits / {s['misses']} misses, {s['tokens_saved']} prompt tokens "
          f"restored (~{s['time_saved_s']:.2f} s of prefill saved); held: "
          + (", ".join(f"{p}: {d['entries']} prompts, {d['bytes'] / 2**20:.2f} MiB" for p, d in s["by_path"].items())
             or "nothing"))


__all__ = ["PREFILL_SHARE", "Server", "open_server", "create_app", "run", "Policy", "PrefixCache", "Job", "Scheduler",
           "uvicorn_config", "GracefulServer"]
