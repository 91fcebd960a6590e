"""Decode benchmark: decode ms/token by cache mode and generated length beside a memory-bandwidth
roofline; the same as ``jaxkv bench`` (method: jaxkv/eval/bench.py, results: docs/PERFORMANCE.md).

    python scripts/bench_decode.py ../shared/data/models/stories260K.bin \
        --modes full,sink4+252,sink4+256:int8,sink4+256:int4 --lengths 256,1024,4096 --json out.json --plot out.png
    python scripts/bench_decode.py synthetic:L=4,D=256,N=8,K=2,F=688,V=4096 --lengths 256,1024
    python scripts/bench_decode.py preset:smollm2-135m --lengths 256,1024 --repeat 3   # configs/ presets
"""

from __future__ import annotations

import sys

from jaxkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
