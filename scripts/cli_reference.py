#!/usr/bin/env python
"""Write docs/CLI.md, the ``jaxkv`` command-line reference, from the argparse definitions in
``jaxkv/cli`` (:func:`jaxkv.cli.build_parser`): every subcommand's ``--help``, whatever
subcommands there are.

Usage::

    python scripts/cli_reference.py           # rewrite docs/CLI.md
    python scripts/cli_reference.py --check   # exit 1 if docs/CLI.md is out of date

tests/test_cli_reference.py fails when docs/CLI.md differs from what :func:`render` gives, so
the reference cannot drift from the flags. The help is wrapped at :data:`WIDTH` columns
whatever the terminal (and never coloured), so the file is the same on every machine.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "CLI.md"
WIDTH = 100  # columns the help is wrapped at (argparse otherwise follows $COLUMNS / the terminal)


def _fixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` formatting its help at WIDTH columns, without colour (Python >= 3.14 colours a terminal's)."""
    formatter_class = parser.formatter_class
    parser.formatter_class = lambda prog: formatter_class(prog, width=WIDTH)
    if hasattr(parser, "color"):
        parser.color = False
    return parser


def _commands(parser: argparse.ArgumentParser):
    """``[(parser, one-line help)]``: ``parser`` (with its description), then each of its
    subcommands in the order they were added, recursively (an alias is listed once)."""
    found = [(parser, parser.description or "")]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                for child, text in _commands(sub):
                    found.append((child, helps.get(name, text) if child is sub else text))
    return found


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    if not text:
        return ""
    return text[0].upper() + text[1:] + ("" if text.endswith((".", "!", "?")) else ".")


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The text of docs/CLI.md for ``parser`` (default: :func:`jaxkv.cli.build_parser`)."""
    if parser is None:
        from jaxkv.cli import build_parser

        parser = build_parser()
    commands = [(_fixed(p), text) for p, text in _commands(parser)]
    lines = [
        "# `jaxkv` command-line reference",
        "",
        "Every subcommand's `--help`, generated from the argparse definitions in `jaxkv/cli` by",
        "`python scripts/cli_reference.py` (do not edit by hand: `tests/test_cli_reference.py` fails",
        f"when this file and the flags differ), wrapped at {WIDTH} columns; `jaxkv SUBCOMMAND --help`",
        "prints the same text wrapped to the terminal.",
        "",
    ]
    lines += [
        f"- [`{p.prog}`](#{p.prog.replace(' ', '-')})" + (f": {' '.join(t.split()).rstrip('.')}" if t else "")
        for p, t in commands
    ]
    for p, text in commands:
        lines += ["", f"## {p.prog}", ""]
        if text:
            lines += [_sentence(text), ""]
        lines += ["```text", p.format_help().rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="do not write: exit 1 if docs/CLI.md is out of date")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(REPO)} is out of date: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(REPO)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
