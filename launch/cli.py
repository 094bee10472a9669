"""Command-line options shared by serve.py, demo.py and comm_profile.py: one flag per engine option, derived
from the options' declaration (launch/options.py), mapped back onto LLM(...) keyword options.

`python -m launch.cli --options-table` prints the markdown table of every option.
"""
from __future__ import annotations

import argparse
import json
import sys

from .options import NAMED, Option, all_options, markdown_table


def _add(group, o: Option) -> None:
    help = o.help if o.flag_default_text is None else f"{o.help} (default: {o.flag_default_text})"
    help = help.replace("%", "%%")   # argparse expands %(default)s and the like in help
    if o.type is bool:
        if o.flag.startswith("--no-"):   # an option on by default that the flag turns off
            group.add_argument(o.flag, dest=o.name, action="store_false", help=help)
        else:
            group.add_argument(o.flag, dest=o.name, action=argparse.BooleanOptionalAction, default=o.flag_default,
                               help=help)
        return
    kind = json.loads if o.type is dict else None if o.type is str else o.type   # a dict option takes JSON
    group.add_argument(o.flag, dest=o.name, type=kind, default=o.flag_default,
                       choices=o.choices, help=help)


def add_engine_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A flag per engine option, in argument groups by config part."""
    groups = {}
    for o in all_options():
        if o.group not in groups:
            groups[o.group] = p.add_argument_group("LLM options" + (f" ({o.group})" if o.group else ""))
        _add(groups[o.group], o)
    return p


def engine_options(args: argparse.Namespace) -> dict:
    """The LLM(...) options named by the parsed arguments (all but model and the rank counts, which each entry
    point resolves: see launch.options.NAMED)."""
    return {o.name: getattr(args, o.name) for o in all_options() if o.name not in NAMED}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="afserve's engine options")
    p.add_argument("--options-table", action="store_true", help="print the markdown table of every option")
    args = p.parse_args(argv)
    if not args.options_table:
        p.print_help()
        return 0
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
