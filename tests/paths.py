"""Where the tests find the repository and the real data files (not a test module).

The data live in ``../shared/data`` beside the repository, or in ``$JAXKV_DATA``.
These are plain constants, not fixtures, because tests use them at import time
(``pytest.mark.parametrize`` arguments, command lines built once per module).
"""

from __future__ import annotations

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = pathlib.Path(os.environ.get("JAXKV_DATA", REPO.parent / "shared" / "data"))
MODELS = DATA / "models"
STORIES_BIN = MODELS / "stories260K.bin"
STORIES_GGUF = MODELS / "stories260K.gguf"
TOK512_MODEL = MODELS / "tok512.model"
TOK512_BIN = MODELS / "tok512.bin"
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = DATA / "text" / "tinystories_valid_head.txt"
GOLDEN = DATA / "golden" / "golden.json"
