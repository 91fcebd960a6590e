"""Evaluation: what a KV cache costs in quality (streaming perplexity and its baselines)."""

from jaxkv.eval.perplexity import perplexity, perplexity_by_range, recompute_nll, token_nll

__all__ = ["perplexity", "perplexity_by_range", "recompute_nll", "token_nll"]
