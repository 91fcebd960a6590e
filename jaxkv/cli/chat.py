"""``jaxkv chat``: the interactive loop over a :class:`~jaxkv.decode.chat.ChatSession`, resumable from a file."""

from __future__ import annotations

import contextlib
import copy
import os
import sys

from jaxkv.cache.spec import CacheSpec
from jaxkv.cli.flags import (
    BOOST_MODE,
    add_cache_flags,
    add_model_flags,
    add_sampler_flags,
    add_tokenizer_flag,
    boosted_spec,
    cache_spec_from_args,
    default_cache_from_args,
    kivi_flags,
    preset_note,
    sampler_from_args,
)
from jaxkv.decode import Sampler
from jaxkv.decode.chat import ChatSession
from jaxkv.errors import INT32_LIMIT, JaxkvError, check_int
from jaxkv.files import check_writable
from jaxkv.io import load_model


def add_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat with a model over one bounded cache (multi-turn, resumable)")
    add_model_flags(c)
    c.add_argument(
        "--tokens", type=int, default=256, metavar="N", help="tokens per reply at most (default: %(default)s)"
    )
    add_sampler_flags(
        c,
        temperature=None,
        temperature_help="0 = greedy (default: 0, or the resumed file's sampler)",
        seed=None,
        seed_help="PRNG seed in [0, 2**32) (default: 0, or the resumed file's)",
    )
    c.add_argument(
        "--system", default=None, metavar="TEXT", help="system message of a new conversation (default: none)"
    )
    c.add_argument(
        "--cache-file",
        default=None,
        metavar="PATH",
        help="resume from PATH if it exists; save there after every turn (default: none, nothing saved)",
    )
    add_tokenizer_flag(c)
    c.add_argument(
        "--chat-template",
        default=None,
        metavar="JINJA|FILE",
        help="chat template (text or a file) overriding the model's (default: the model's)",
    )
    add_cache_flags(
        c,
        defaults={
            dest: f"{shown}, or the resumed file's"
            for dest, shown in (
                ("streaming_llm_sink", "4"),
                ("streaming_llm_window", "what fills min(1024, the model's trained context) with the sinks"),
                ("positions", "cache"),
                ("kv_quantize", "fp32"),
                ("kv_group_size", str(CacheSpec.group_size)),
                ("kv_residual", str(CacheSpec.residual)),
                ("max_len", "none, a StreamingLLM cache"),
                ("kv_boost_layers", "none"),
                ("kv_boost_quantize", BOOST_MODE),
            )
        },
    )
    c.set_defaults(
        func=run,
        streaming_llm_sink=None,
        streaming_llm_window=None,
        max_len=None,
        kv_quantize=None,
        kv_group_size=None,
        kv_residual=None,
        positions=None,
    )  # None = not given (chat picks defaults)


CHAT_HELP = (
    "commands: /reset (forget the conversation), /stats (tokens seen, tokens stored, cache bytes), "
    "/help, /quit; end of input (Ctrl-D) quits; start a message with // to send one beginning with /"
)


def chat_loop(
    session: ChatSession,
    *,
    cache_file: str | None = None,
    stdin=None,
    stdout=None,
    stderr=None,
    interactive: bool | None = None,
) -> None:
    """The interactive loop of ``jaxkv chat``: read a message, stream the reply, save the session.

    On a terminal it prompts with ``> `` (line editing through ``readline`` when available)
    and a failed turn (a full cache, Ctrl-C during a reply) is reported and discarded; otherwise
    it reads one message per line and a failed turn raises. Returns at end of input or ``/quit``.
    With ``cache_file`` the session is saved after every turn and every ``/reset``.
    """
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if interactive is None:
        interactive = stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing for input())
        print(
            f"[jaxkv chat: {session.model.config.name}; cache {session.spec.describe()}; {CHAT_HELP}]",
            file=stderr,
            flush=True,
        )

    def write(piece: str) -> None:
        stdout.write(piece)
        stdout.flush()

    while True:
        try:
            line = input("> ") if interactive and stdin is sys.stdin else stdin.readline()
        except EOFError:
            line = ""
        if line == "":  # end of input
            if interactive:
                write("\n")
            return
        message = line.rstrip("\r\n")
        if not message.strip():
            continue
        if message.startswith("/") and not message.startswith("//"):
            command = message.split()[0].lower()
            if command in ("/quit", "/exit"):
                return
            if command == "/reset":
                session.reset()
                if cache_file:
                    _save(session, cache_file)
                write("[conversation reset]\n")
            elif command == "/stats":
                write(f"[{session.stats().summary()}]\n")
            elif command == "/help":
                write(f"[{CHAT_HELP}]\n")
            else:
                print(f"jaxkv: unknown command {command}; {CHAT_HELP}", file=stderr, flush=True)
            continue
        if message.startswith("//"):
            message = message[1:]
        try:
            session.send(message, on_text=write)
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("\n[interrupted: the turn was discarded]", file=stderr, flush=True)
            continue
        except JaxkvError as e:
            if not interactive:
                raise
            print(f"\njaxkv: error: {e}", file=stderr, flush=True)
            continue
        write("\n")
        if session.finish_reason == "cache_full":
            print(
                "[the full cache is used up: /reset, or chat with a StreamingLLM cache (--streaming-llm-window M)]",
                file=stderr,
                flush=True,
            )
        if cache_file:
            _save(session, cache_file)


def _save(session: ChatSession, path: str) -> None:
    """``session.save(path)``; a failed write (the disk filled up, the folder went away) is one line, not a traceback."""
    try:
        session.save(path)
    except OSError as e:
        raise JaxkvError(f"--cache-file {path}: cannot save the conversation ({e.strerror})") from None


def run(args) -> None:
    """``jaxkv chat``: build (or resume) a :class:`ChatSession` from parsed flags and run :func:`chat_loop`.

    Cache flags left out mean :func:`default_cache_spec` for a new session and the file's
    spec for a resumed one; given, they must match the file's. Sampler flags and ``--seed``
    left out mean greedy / seed 0 for a new session and the saved ones for a resumed one.
    """
    check_int("--tokens", args.tokens, 1, INT32_LIMIT)
    sampler = sampler_from_args(args, temperature=args.temperature or 0.0)  # checked, --seed too, before loading
    if all(v is None for v in (args.temperature, args.top_k, args.top_p)):
        sampler = None  # not given: greedy, or the resumed file's
    flags = dict(
        streaming_llm_sink=None,
        streaming_llm_window=None,
        max_len=None,
        kv_quantize="fp32",
        kv_group_size=None,
        kv_residual=None,
        positions="cache",  # None: resolved by kivi_flags
        kv_quantize_k=None,
        kv_quantize_v=None,
        kv_residual_dtype=None,  # None: CacheSpec's
        kv_pre_rope=None,
        kv_hadamard=None,
        kv_codebook=None,
        kv_clip=None,
        kv_scale_dtype=None,
        kv_preset=None,
        kv_keep=None,
        kv_keep_score=None,
        kv_keep_quantize=None,
        kv_boost_layers=None,
        kv_boost_quantize=None,
    )  # None: boosted_spec's
    given = {k for k in flags if getattr(args, k) is not None}
    ns = copy.copy(args)
    for k, default in flags.items():
        if getattr(ns, k) is None:
            setattr(ns, k, default)
    if given and ns.streaming_llm_window is None and ns.max_len is None and ns.streaming_llm_sink is None:
        spec = "default"  # only storage/positions flags: the default window with them
        kivi_flags(ns)  # checked before the model loads
    elif given:
        spec = cache_spec_from_args(ns)
    else:
        spec = None
    if args.cache_file:
        check_writable(args.cache_file, "--cache-file")  # before the first turn, not after its reply
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    model = load_model(args.model, tokenizer=args.tokenizer, weights=args.weights)
    if spec == "default":
        spec = default_cache_from_args(ns, model.config)
    if spec is not None:
        spec = boosted_spec(ns, spec, model.config.n_layers)
        preset_note(ns, model.config, spec)
    path = args.cache_file
    if path and os.path.exists(path):
        session = ChatSession.load(
            path, model, cache=spec, sampler=sampler, seed=args.seed, max_new_tokens=args.tokens, chat_template=template
        )
        print(f"[resumed {path}: {session.stats().summary()}]", file=sys.stderr, flush=True)
    else:
        session = ChatSession(
            model,
            spec,
            sampler=sampler or Sampler(),
            seed=args.seed or 0,
            max_new_tokens=args.tokens,
            system=args.system,
            chat_template=template,
        )
    chat_loop(session, cache_file=path)
