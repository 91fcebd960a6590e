"""The finite check every loader runs on every tensor it reads: a NaN or an infinity in a
weight (a damaged GGUF scale, a bad conversion) would make every logit NaN and every sampled
token 0, so it is refused at load, naming the file and the tensor."""

from __future__ import annotations

import numpy as np

from jaxkv.errors import ModelFileError


def check_finite(file: str, tensor: str, values: np.ndarray) -> None:
    """Refuse a tensor holding a NaN or an infinity.

    Args:
      file: how messages name the file (its name or path).
      tensor: the tensor's name in the file (``blk.3.attn_q.weight``, ``wq``, ...).
      values: its values as the model will use them (a float array, after dequantisation).
    Raises:
      ModelFileError: ``FILE: tensor 'NAME' holds N non-finite values (NaN or infinity) of M,
        the first at index [i, j]: the file is corrupt``.
    """
    finite = np.isfinite(values)
    if finite.all():
        return
    bad = finite.size - np.count_nonzero(finite)
    first = [int(i) for i in np.unravel_index(np.argmin(finite), finite.shape)]
    raise ModelFileError(
        f"{file}: tensor {tensor!r} holds {bad:,} non-finite value{'s' if bad > 1 else ''} (NaN or infinity) of "
        f"{finite.size:,}, the first at index {first}: the file is corrupt"
    )
