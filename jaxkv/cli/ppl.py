"""``jaxkv ppl``: teacher-forced perplexity of a text file through the KV cache (or the recompute oracle)."""

from __future__ import annotations

import os
import time

import numpy as np

from jaxkv.cache.memory import bits_text
from jaxkv.cli.flags import (
    add_cache_flags,
    add_model_flags,
    add_tokenizer_flag,
    boost_mode_for,
    boosted_spec,
    cache_spec_from_args,
    preset_note,
)
from jaxkv.decode.loop import new_cache_bits
from jaxkv.errors import JaxkvError, check_int
from jaxkv.eval.perplexity import perplexity, perplexity_by_range, recompute_nll, token_nll, write_nll
from jaxkv.eval.sensitivity import layer_sensitivity
from jaxkv.files import check_writable
from jaxkv.io import load_model

SUGGESTED = (2, 4)  # --kv-sensitivity: the top-k sets measured and suggested


def add_parser(sub) -> None:
    p = sub.add_parser("ppl", help="teacher-forced perplexity of a text through the KV cache")
    add_model_flags(p)
    p.add_argument(
        "--text",
        required=True,
        metavar="FILE",
        help="UTF-8 text, scored as one stream (BOS first if the tokenizer adds one)",
    )
    p.add_argument(
        "--tokens", type=int, default=None, metavar="N", help="score only the first N tokens (default: the whole file)"
    )
    add_tokenizer_flag(p)
    p.add_argument(
        "--nll-out",
        default=None,
        metavar="FILE",
        help="write per-token NLL in nats: one per line, or NumPy if FILE ends in .npy (default: none)",
    )
    p.add_argument(
        "--recompute-window",
        type=int,
        default=None,
        metavar="W",
        help="instead of the cache, the StreamingLLM paper's oracle: re-encode the last W tokens for every token (O(N*W)) "
        "(default: none, the cache)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=128,
        metavar="T",
        help="tokens per compiled call, speed only (default: %(default)s)",
    )
    p.add_argument(
        "--kv-sensitivity",
        action="store_true",
        help="instead of one perplexity, the per-layer sensitivity pass of an int* cache: the perplexity with each "
        "single layer in --kv-boost-quantize, the layers ranked by the perplexity won back, then the "
        f"top {' and top '.join(map(str, SUGGESTED))} boosted together, measured, with their effective bits "
        f"per element and --kv-boost-layers flags; costs 1 + L + {len(SUGGESTED)} runs of the text (L layers)",
    )
    add_cache_flags(p)
    p.set_defaults(func=run)


def run(args) -> None:
    if args.kv_sensitivity:
        for given, flag in (
            (args.recompute_window is not None, "--recompute-window"),
            (args.nll_out, "--nll-out"),
            (args.kv_boost_layers is not None, "--kv-boost-layers"),
        ):
            if given:
                raise JaxkvError(
                    f"--kv-sensitivity boosts each layer alone from the cache the flags describe: leave out {flag}"
                )
    if args.tokens is not None and args.tokens < 2:
        raise JaxkvError(f"--tokens {args.tokens}: expected an integer >= 2 (one token to condition on, one to score)")
    check_int("--chunk", args.chunk, 1)
    recompute = args.recompute_window is not None
    if recompute:
        check_int("--recompute-window", args.recompute_window, 1)
        storage = (
            args.kv_quantize_k,
            args.kv_quantize_v,
            args.kv_residual_dtype,
            args.kv_pre_rope,
            args.kv_hadamard,
            args.kv_codebook,
            args.kv_clip,
            args.kv_scale_dtype,
            args.kv_preset,
            args.kv_boost_layers,
            args.kv_boost_quantize,
        )
        if (
            args.streaming_llm_window is not None
            or args.kv_quantize != "fp32"
            or any(storage)
            or args.positions != "absolute"
            or args.max_len is not None
        ):
            raise JaxkvError(
                "--recompute-window re-encodes every window from scratch: of the cache flags it takes only --streaming-llm-sink"
            )
        if args.streaming_llm_sink is not None:
            check_int("--streaming-llm-sink", args.streaming_llm_sink, 0)
    elif args.kv_sensitivity:  # validate the cache flags before loading the model
        boost_mode_for(args, cache_spec_from_args(args, 2), "--kv-sensitivity")
    else:
        boosted_spec(args, cache_spec_from_args(args, 2))
    if not os.path.isfile(args.text):
        raise JaxkvError(f"--text {args.text}: no such file")
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise JaxkvError(f"--text {args.text}: cannot read it as UTF-8 text ({e})") from None
    if not text.strip():
        raise JaxkvError(f"--text {args.text}: the file is empty (no text to score)")
    if args.nll_out:
        check_writable(args.nll_out, "--nll-out", not_same_as=args.text)  # before scoring, not after

    model = load_model(args.model, tokenizer=args.tokenizer, weights=args.weights)
    ids = model.tokenizer.encode(text)  # one stream, BOS first if the tokenizer adds one
    if args.tokens is not None:
        ids = ids[: args.tokens]
    if len(ids) < 2:
        raise JaxkvError(f"--text {args.text}: {len(ids)} token(s); perplexity needs at least 2")
    if args.kv_sensitivity:
        return sensitivity(args, model, ids)
    t0 = time.perf_counter()
    if recompute:
        sink = args.streaming_llm_sink or 0
        what = f"sliding window with recomputation, window {args.recompute_window}" + (
            f" after {sink} sinks" if sink else ""
        )
        nll = recompute_nll(model, ids, window=args.recompute_window, sink=sink, progress=True)
    else:
        spec = boosted_spec(args, cache_spec_from_args(args, len(ids)), model.config.n_layers)
        preset_note(args, model.config, spec)
        what = f"cache {spec.describe()}; {bits_text(*new_cache_bits(model.config, spec))}"
        nll = token_nll(model, ids, cache=spec, chunk=args.chunk, progress=True)
    seconds = time.perf_counter() - t0
    print(
        f"{os.path.basename(model.path or 'model')} on {os.path.basename(args.text)}: {len(ids)} tokens, {len(nll)} scored; {what}"
    )
    print(
        f"perplexity {perplexity(nll):.4f}  (mean NLL {float(np.mean(nll)):.4f} nats/token; "
        f"{seconds:.1f} s, {len(nll) / max(seconds, 1e-9):.0f} tokens/s, compile included)"
    )
    for lo, hi, ppl, count in perplexity_by_range(nll):
        print(f"  positions [{lo}, {hi}): perplexity {ppl:.4f}  ({count} tokens)")
    if args.nll_out:
        try:
            write_nll(args.nll_out, nll)
        except OSError as e:
            raise JaxkvError(f"--nll-out {args.nll_out}: cannot write it ({e})") from None
        print(f"per-token NLL (nats) written to {args.nll_out}")


def sensitivity(args, model, ids) -> None:
    """``--kv-sensitivity``: :func:`jaxkv.eval.layer_sensitivity` of the cache flags' spec, as a table."""
    spec = cache_spec_from_args(args, len(ids))
    mode = boost_mode_for(args, spec, "--kv-sensitivity")
    n_layers = model.config.n_layers
    t0 = time.perf_counter()
    result = layer_sensitivity(
        model, ids, spec, mode=mode, top=[k for k in SUGGESTED if k <= n_layers], chunk=args.chunk, progress=True
    )
    seconds = time.perf_counter() - t0
    print(
        f"{os.path.basename(model.path or 'model')} on {os.path.basename(args.text)}: {len(ids)} tokens, "
        f"{len(ids) - 1} scored; cache {spec.describe()}; {bits_text(*result.base_bits)}"
    )
    print(
        f"perplexity {result.base_ppl:.4f}; each of the {n_layers} layers alone in {mode} "
        f"({1 + n_layers + len(result.top)} runs, {seconds:.1f} s, compile included):"
    )
    print(f"{'rank':>4}  {'layer':>5}  {'perplexity':>10}  {'gain':>8}")
    for rank, layer in enumerate(result.ranking, 1):
        print(f"{rank:>4}  {layer:>5}  {result.ppl[layer]:>10.4f}  {result.gain[layer]:>8.4f}")
    for boost in result.top:
        print(
            f"top {len(boost.layers)} in {mode}: --kv-boost-layers {boost.flag} --kv-boost-quantize {mode}: "
            f"perplexity {boost.ppl:.4f} (gain {result.base_ppl - boost.ppl:.4f}); {bits_text(boost.store_bits, boost.bits)}"
        )
