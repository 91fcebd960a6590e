"""docs/CLI.md is what scripts/cli_reference.py generates from the jaxkv/cli argparse definitions
now: a flag added, removed or reworded without regenerating the reference fails here."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from paths import REPO

from jaxkv.cli import build_parser

pytestmark = pytest.mark.jax_independent  # docs/CLI.md against argparse


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_cli_md_is_the_generated_reference(generator):
    current = (REPO / "docs" / "CLI.md").read_text(encoding="utf-8")
    assert current == generator.render(), "docs/CLI.md is out of date: run python scripts/cli_reference.py"


def test_the_reference_has_every_subcommand_whatever_the_terminal_width(generator, monkeypatch):
    wide = generator.render()
    monkeypatch.setenv("COLUMNS", "43")  # what argparse's own formatter would wrap at
    assert generator.render() == wide
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert subcommands
    for name in subcommands:  # sample, chat, ...: whatever jaxkv/cli defines
        assert f"\n## jaxkv {name}\n" in wide and f"\nusage: jaxkv {name} " in wide
