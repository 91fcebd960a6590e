"""Batch decoding of a JSONL file of prompts; the same as ``jaxkv batch`` (see docs/BATCH.md).

    python scripts/batch_decode.py ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --input prompts.jsonl --output results.jsonl --batch-size 16 --tokens 64 \
        --streaming-llm-sink 4 --streaming-llm-window 252
"""

from __future__ import annotations

import sys

from jaxkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
