"""``jaxkv serve``: an OpenAI-compatible HTTP server with continuous batching
(:class:`jaxkv.serve.engine.Engine` under :func:`jaxkv.serve.app.create_app`, run by uvicorn).

The port is bound first (a port in use is one error line, before the model loads); uvicorn
serves at once while the engine warms up in a thread (``/health`` answers 503 until it is
ready), and one line on stderr says when it is, naming the cache: without --streaming-llm-window
or --max-len, the bounded default of :data:`~jaxkv.decode.chat.DEFAULT_CACHE_TOKENS`. SIGTERM or SIGINT: no new requests, the
in-flight ones get ``--shutdown-timeout`` seconds, then end (finish reason ``length``), their
streams closed with ``[DONE]``; the command exits 0. docs/SERVING.md has the details.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import socket
import sys
import threading
import time

from jaxkv.cache.spec import CacheSpec
from jaxkv.cli.flags import (
    add_cache_flags,
    add_model_flags,
    add_tokenizer_flag,
    boosted_spec,
    cache_spec_from_args,
    default_cache_from_args,
    kivi_flags,
    preset_note,
)
from jaxkv.decode.chat import DEFAULT_CACHE_TOKENS, DEFAULT_SINK
from jaxkv.errors import INT32_LIMIT, JaxkvError, check_int
from jaxkv.io import load_model

API_KEY_ENV = "JAXKV_API_KEY"


def add_parser(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions, "
        "/v1/completions (streaming or not), /v1/models, /health, /metrics. "
        "See docs/SERVING.md.",
    )
    add_model_flags(s)
    add_tokenizer_flag(s)
    s.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="HOST",
        help="address to listen on (0.0.0.0: every interface) (default: %(default)s)",
    )
    s.add_argument(
        "--port",
        type=int,
        default=8000,
        metavar="PORT",
        help="TCP port to listen on; 0 = any free one (printed once ready) (default: %(default)s)",
    )
    s.add_argument(
        "--model-name",
        default=None,
        metavar="NAME",
        help="the model id clients pass as `model` and /v1/models lists (default: the model file's "
        "name without its extension)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` on /v1/* (/health and /metrics stay open) "
        f"(default: ${API_KEY_ENV}, else none)",
    )
    s.add_argument(
        "--slots",
        type=int,
        default=4,
        metavar="N",
        help="decode slots: requests generated together in one batch (default: %(default)s)",
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="Q",
        help="requests waiting for a slot at most; beyond, 429 with Retry-After (default: %(default)s)",
    )
    s.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=256 << 20,
        metavar="B",
        help="bytes of cached prompt prefixes (their KV states) reused by later requests; 0 = off "
        "(default: %(default)s, 256 MiB)",
    )
    s.add_argument(
        "--max-tokens-default",
        type=int,
        default=256,
        metavar="N",
        help="tokens to generate when a request gives no max_tokens (a full cache: at most what fits) "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        metavar="N",
        help="the token budget of an engine step (vLLM's name): every decoding slot's next token first, "
        "then waiting prompts' chunks in the rest; one prompt's chunk alone may take it all (default: %(default)s)",
    )
    s.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="tokens per streamed chunk at most (vLLM's name): 1 sends every token as it is sampled "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are cut "
        "short (finish reason length) (default: %(default)s)",
    )
    s.add_argument(
        "--ray",
        action="store_true",
        help="serve on Ray Serve: --replicas engines behind one OpenAI-compatible ingress, each request "
        "sent to the replica that holds its prompt's prefix (docs/SCALING.md); a local Ray instance, or "
        "the cluster at $RAY_ADDRESS; needs jaxkv[cluster]",
    )
    s.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="with --ray: engine replicas, each with --slots slots and its own prefix cache (default: 2)",
    )
    s.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        metavar="C",
        help="with --ray: Ray CPUs each replica reserves (default: 1)",
    )
    s.add_argument(
        "--route-imbalance",
        type=int,
        default=None,
        metavar="N",
        help="with --ray: requests a replica holding a prompt's prefix may run above the least loaded "
        "replica and still be sent it (beyond: power of two choices) (default: --slots)",
    )
    add_cache_flags(
        s,
        defaults={
            "streaming_llm_sink": f"{DEFAULT_SINK} with the default window, else 0",
            "streaming_llm_window": f"what fills min({DEFAULT_CACHE_TOKENS}, the model's trained context) "
            "with the sinks, unless --max-len is given",
            "positions": "cache for the default window, else absolute",
            "max_len": "none, a StreamingLLM cache; given: a full cache of N tokens per slot, prompt and reply",
        },
    )
    s.set_defaults(func=run, positions=None)  # None: cache for the default window, else absolute


def _default_spec(args, config) -> CacheSpec:
    """The cache of a ``jaxkv serve`` without --streaming-llm-window or --max-len: ``jaxkv chat``'s
    default (:func:`jaxkv.decode.chat.default_cache_spec`: a StreamingLLM cache of
    :data:`~jaxkv.decode.chat.DEFAULT_SINK` sinks and a window filling
    ``min(DEFAULT_CACHE_TOKENS, the model's trained context)`` tokens, RoPE positions ``cache``),
    in the storage the other cache flags give.

    Raises:
      JaxkvError: flags that leave no window (e.g. a sink or KIVI residual as large as the context).
    """
    sink = DEFAULT_SINK if args.streaming_llm_sink is None else args.streaming_llm_sink
    return default_cache_from_args(args, config, sink=sink)


def _model_spec(args, spec: CacheSpec | None, config):
    """The cache the engine serves: ``spec`` (None: :func:`_default_spec`) with the boost layers."""
    if spec is None:
        spec = _default_spec(args, config)
    spec = boosted_spec(args, spec, config.n_layers)
    preset_note(args, config, spec)
    return spec


def _api_key(args) -> str | None:
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and (not key.strip() or any(c.isspace() for c in key)):
        shown = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        raise JaxkvError(f"{shown}: expected a key without spaces (got {key!r})")
    return key


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6, as the address resolves).

    Raises:
      JaxkvError: an address that does not resolve, or a port in use or not allowed.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise JaxkvError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise JaxkvError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _uvicorn_server(uvicorn, config, on_signal):
    """A ``uvicorn.Server`` that calls ``on_signal()`` on SIGTERM/SIGINT (the engine's shutdown
    starts at once, so streams end before uvicorn waits for their connections) and, unlike
    uvicorn's own, does not re-raise the signal once shut down: the command exits 0."""

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            on_signal()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def _checked(args) -> tuple[CacheSpec | None, str | None]:
    """Every flag checked before the model loads: ``(spec, api_key)``, the spec None for the
    default cache (sized from the model's context once it is loaded)."""
    check_int("--slots", args.slots, 1, INT32_LIMIT)
    check_int("--max-queue", args.max_queue, 0, INT32_LIMIT)
    check_int("--port", args.port, 0, 65536)
    check_int("--prefix-cache-bytes", args.prefix_cache_bytes, 0)
    check_int("--max-tokens-default", args.max_tokens_default, 1, INT32_LIMIT)
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise JaxkvError(f"--shutdown-timeout {args.shutdown_timeout}: expected seconds >= 0")
    check_int("--max-num-batched-tokens", args.max_num_batched_tokens, 1, INT32_LIMIT)
    check_int("--stream-interval", args.stream_interval, 1, INT32_LIMIT)
    if args.model_name is not None and not args.model_name.strip():
        raise JaxkvError("--model-name: expected a non-empty name")
    ray_flags = {
        "--replicas": args.replicas,
        "--replica-cpus": args.replica_cpus,
        "--route-imbalance": args.route_imbalance,
    }
    if not args.ray and any(v is not None for v in ray_flags.values()):
        given = [flag for flag, v in ray_flags.items() if v is not None]
        raise JaxkvError(f"{', '.join(given)}: Ray Serve's flags: add --ray")
    if args.ray:
        args.replicas = check_int("--replicas", 2 if args.replicas is None else args.replicas, 1, 1024)
        args.route_imbalance = check_int(
            "--route-imbalance", args.slots if args.route_imbalance is None else args.route_imbalance, 0, INT32_LIMIT
        )
        args.replica_cpus = 1.0 if args.replica_cpus is None else args.replica_cpus
        if not (math.isfinite(args.replica_cpus) and args.replica_cpus >= 0):
            raise JaxkvError(f"--replica-cpus {args.replica_cpus}: expected CPUs >= 0")
    api_key = _api_key(args)
    default_cache = args.streaming_llm_window is None and args.max_len is None
    if args.positions is None:
        args.positions = "cache" if default_cache else "absolute"
    if default_cache:  # sized from the model's context once it is loaded: the KIVI flags checked now
        kivi_flags(args)
        return None, api_key
    spec = cache_spec_from_args(args)  # the boost layers' range is checked once the model is known
    boosted_spec(args, spec)
    return spec, api_key


def _engine_options(args) -> dict:
    """:class:`~jaxkv.serve.engine.Engine`'s keyword arguments from the flags."""
    return dict(
        slots=args.slots,
        max_queue=args.max_queue,
        prefix_cache_bytes=args.prefix_cache_bytes,
        max_num_batched_tokens=args.max_num_batched_tokens,
        stream_interval=args.stream_interval,
    )


def _app_options(args, api_key: str | None, config) -> dict:
    """:func:`~jaxkv.serve.app.create_app`'s keyword arguments from the flags."""
    return dict(
        model_name=args.model_name or os.path.splitext(config.name)[0],
        api_key=api_key,
        default_max_tokens=args.max_tokens_default,
        shutdown_timeout=args.shutdown_timeout,
    )


def _cluster():
    """:mod:`jaxkv.serve.cluster` (Ray Serve's part of jaxkv).

    Raises:
      JaxkvError: Ray Serve is not installed (the ``cluster`` extra).
    """
    try:
        from jaxkv.serve import cluster
    except ImportError as e:
        raise JaxkvError(
            f"jaxkv serve --ray needs Ray Serve ({e.name} is missing): pip install 'jaxkv[cluster]'"
        ) from None
    return cluster


def _ray_application(args, spec: CacheSpec | None, api_key: str | None):
    """``(application, model name, spec)``: the Ray Serve application of
    :func:`jaxkv.serve.cluster.build_application` for the flags (the model loaded here once, for
    its config and its default cache; each replica loads its own)."""
    from jaxkv.cli import use_compile_cache

    build_application = _cluster().build_application
    config = load_model(args.model, tokenizer=args.tokenizer, weights="fp32").config
    spec = _model_spec(args, spec, config)
    options = _app_options(args, api_key, config)
    app = build_application(
        args.model,
        spec,
        replicas=args.replicas,
        tokenizer=args.tokenizer,
        weights=args.weights,
        engine_options=_engine_options(args),
        app_options=options,
        shutdown_timeout=args.shutdown_timeout,
        replica_cpus=args.replica_cpus,
        router_options={"imbalance": args.route_imbalance},
        replica_setup=use_compile_cache,
    )
    return app, options["model_name"], spec


def ray_app(config: dict):
    """A Ray Serve application builder (``serve run jaxkv.cli.serve:ray_app argv="MODEL ..."``, or
    ``import_path`` in a ``serve run`` / KubeRay config such as configs/ray-serve.yaml): ``argv``
    holds the ``jaxkv serve`` flags (``--ray`` implied; ``--host``/``--port`` are Ray Serve's
    ``http_options``).

    Raises:
      JaxkvError: a bad flag, as ``jaxkv serve`` names it.
    """
    from jaxkv.cli import build_parser

    argv = shlex.split(str(config.get("argv", "")))
    args = build_parser().parse_args(["serve", *argv])
    args.ray = True
    spec, api_key = _checked(args)
    return _ray_application(args, spec, api_key)[0]


def _run_ray(args, spec: CacheSpec | None, api_key: str | None) -> int:
    """``jaxkv serve --ray``: the application on a local Ray instance (or ``$RAY_ADDRESS``'s), its
    HTTP proxy on ``--host``/``--port``, until SIGTERM/SIGINT (then Ray Serve stops the replicas,
    each giving its requests ``--shutdown-timeout`` seconds)."""
    _cluster()  # Ray Serve is installed, before anything starts
    sock = _bind(args.host, args.port)  # the address is usable (and port 0 picks one); Ray Serve's proxy takes it
    url, port = _url(sock), sock.getsockname()[1]
    sock.close()
    import ray
    from ray import serve

    ray.init(logging_level="warning")  # before jax starts its threads here: Ray forks its processes
    app, name, spec = _ray_application(args, spec, api_key)
    stop = threading.Event()
    try:
        quiet = {"log_level": "WARNING"}  # as jaxkv serve's uvicorn: no line per request
        serve.start(http_options={"host": args.host, "port": port}, logging_config=quiet)
        serve.run(app, name="jaxkv", route_prefix="/", logging_config=quiet)
        for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's start, which sets its own
            signal.signal(sig, lambda *_: stop.set())
        print(
            f"jaxkv serve: listening on {url} (Ray Serve: {args.replicas} replicas of model {name}, "
            f"{args.slots} slots each, cache {spec.describe()})",
            file=sys.stderr,
            flush=True,
        )
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def run(args) -> int:
    """``jaxkv serve``: returns the exit code (0 after SIGTERM/SIGINT; a failed warm-up raises JaxkvError: 2)."""
    spec, api_key = _checked(args)
    default_cache = spec is None
    if args.ray:
        return _run_ray(args, spec, api_key)
    try:
        import uvicorn

        from jaxkv.serve.app import create_app
        from jaxkv.serve.engine import Engine
    except ImportError as e:
        raise JaxkvError(
            f"jaxkv serve needs the serving packages ({e.name} is missing): pip install 'jaxkv[serve]'"
        ) from None

    sock = _bind(args.host, args.port)
    model = load_model(args.model, tokenizer=args.tokenizer, weights=args.weights)
    spec = _model_spec(args, spec, model.config)
    engine = Engine(model, spec, **_engine_options(args))
    options = _app_options(args, api_key, model.config)
    name = options["model_name"]
    app = create_app(engine, **options)
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=int(math.ceil(args.shutdown_timeout)) + 5
    )
    server = _uvicorn_server(uvicorn, config, app.state.serving.shutdown.begin)
    failed: list[BaseException] = []

    def warm_up() -> None:
        try:
            engine.start()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread, which exits
            failed.append(e)
            server.should_exit = True
            return
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started and not server.should_exit:
            print(
                f"jaxkv serve: listening on {_url(sock)} (model {name}, {engine.slots} slots, "
                f"cache {engine.spec.describe()}"
                + (", the default: --streaming-llm-window M or --max-len N to choose" if default_cache else "")
                + ")",
                file=sys.stderr,
                flush=True,
            )

    warming = threading.Thread(target=warm_up, name="jaxkv-serve-warm-up", daemon=True)
    warming.start()
    server.run(sockets=[sock])
    if failed:
        e = failed[0]
        raise e if isinstance(e, JaxkvError) else JaxkvError(f"the engine failed to warm up: {type(e).__name__}: {e}")
    if warming.is_alive():  # shut down while still compiling: leave without waiting for XLA
        sys.stderr.flush()
        os._exit(0)
    return 0
