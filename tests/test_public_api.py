"""The public API (jaxkv.__all__, jaxkv.eval.__all__) imports, and the alias modules removed in
0.2.0 are gone (CHANGELOG.md lists what to import instead)."""

from __future__ import annotations

import importlib

import pytest

import jaxkv
import jaxkv.eval

REMOVED = {  # removed module -> where its names live now
    "jaxkv.sampling": "jaxkv.decode",
    "jaxkv.chat": "jaxkv.decode.chat",
    "jaxkv.batch": "jaxkv.decode.batch",
    "jaxkv.parallel": "jaxkv.decode.parallel",
    "jaxkv.bench": "jaxkv.eval.bench",
    "jaxkv.audit": "jaxkv.eval.audit",
}


@pytest.mark.parametrize("module", [jaxkv, jaxkv.eval], ids=lambda m: m.__name__)
def test_every_public_name_imports_and_is_not_none(module):
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert getattr(module, name, None) is not None, f"{module.__name__}.{name}"
    namespace = {}
    exec(f"from {module.__name__} import *", namespace)  # a star import gives every name of __all__
    assert set(module.__all__) <= set(namespace)


@pytest.mark.parametrize("removed", sorted(REMOVED))
def test_the_removed_alias_modules_are_gone(removed):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(removed)
    importlib.import_module(REMOVED[removed])  # what replaces it imports
