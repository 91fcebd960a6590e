"""Evaluation: what a KV cache costs in quality (streaming perplexity and its baselines,
fake-quantised K/V, greedy agreement, per-layer sensitivity, retrieval of a passkey or a line
at a depth of a long prompt) and in memory (bytes of the cache's pytree leaves)."""

from jaxkv.eval.fake_quant import FakeQuantKV
from jaxkv.eval.perplexity import (
    paired_ratio,
    perplexity,
    perplexity_by_range,
    recompute_nll,
    teacher_forced_nll,
    token_nll,
)
from jaxkv.eval.retrieval import (
    RetrievalAnswer,
    RetrievalPrompt,
    RetrievalResult,
    plot_heatmap,
    retrieval_accuracy,
    retrieval_prompt,
    score_answer,
)
from jaxkv.eval.sensitivity import Boost, LayerSensitivity, layer_sensitivity
from jaxkv.eval.tables import (
    allocated_report,
    filled_report,
    greedy_markdown,
    greedy_match,
    memory_markdown,
    memory_rows,
    memory_spec,
    prefix_match,
)

__all__ = [
    "Boost",
    "FakeQuantKV",
    "LayerSensitivity",
    "RetrievalAnswer",
    "RetrievalPrompt",
    "RetrievalResult",
    "allocated_report",
    "filled_report",
    "greedy_markdown",
    "greedy_match",
    "layer_sensitivity",
    "memory_markdown",
    "memory_rows",
    "memory_spec",
    "paired_ratio",
    "perplexity",
    "perplexity_by_range",
    "plot_heatmap",
    "prefix_match",
    "recompute_nll",
    "retrieval_accuracy",
    "retrieval_prompt",
    "score_answer",
    "teacher_forced_nll",
    "token_nll",
]
