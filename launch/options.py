"""Every engine option, read from its one declaration: the fields of the config tree (launch/config.py), whose
defaults are the options' defaults and whose metadata holds their help, choices and flag details.

LLM(model, attention_ranks, expert_ranks, **options) takes them as keywords (EngineConfig.from_options), the
entry points as flags (launch/cli.py), and markdown_table() documents both.
"""
from __future__ import annotations

import inspect
import types
import typing
from dataclasses import MISSING, dataclass

from .config import GROUPS, EngineConfig, option_fields

# The options LLM(...) and EngineConfig.from_options name before **options; each entry point resolves these
# three itself (--model's and --expert-ranks' defaults differ from LLM's), the rest pass through engine_options.
NAMED = tuple(p for p in inspect.signature(EngineConfig.from_options).parameters if p != "options")


@dataclass(frozen=True, slots=True)
class Option:
    name: str               # the LLM(...) keyword, the EngineConfig field
    group: str              # the EngineConfig field that holds it ("parallel", "cache", "scheduler"), or ""
    type: type              # int, float, str or bool (None is allowed where the default is None)
    default: object         # the LLM default; MISSING where the option is required
    help: str
    choices: tuple | None
    flag: str               # "--" + name with "_" -> "-", unless the declaration names another
    flag_default: object    # the flag's default: the LLM default unless the declaration says otherwise
    flag_default_text: str | None   # how the help and the table describe a flag default that differs

    @property
    def required(self) -> bool:
        return self.default is MISSING


def _plain_type(hint) -> type:
    """int | None -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def _hints() -> dict[str, object]:
    hints = typing.get_type_hints(EngineConfig)
    for cls in GROUPS.values():
        hints.update(typing.get_type_hints(cls))
    return hints


def all_options() -> list[Option]:
    """Every option, in declaration order."""
    hints = _hints()
    out = []
    for group, f in option_fields():
        meta = f.metadata
        out.append(Option(name=f.name, group=group, type=_plain_type(hints[f.name]), default=f.default,
                          help=meta["help"], choices=meta.get("choices"),
                          flag=meta.get("flag", "--" + f.name.replace("_", "-")),
                          flag_default=meta.get("flag_default", f.default),
                          flag_default_text=meta.get("flag_default_text")))
    return out


def _code(value) -> str:
    return f"`{value}`"


def markdown_table() -> str:
    """The options table: every LLM(...) keyword with its flag, type, default and help."""
    rows = ["| Option | Flag | Type | Default | Description |", "|---|---|---|---|---|"]
    for o in all_options():
        flag = _code(o.flag)
        if o.type is bool and not o.flag.startswith("--no-"):
            flag = f"{_code(o.flag)}, {_code('--no-' + o.flag[2:])}"
        default = "required" if o.required else _code(o.default)
        if o.flag_default_text:
            default += f"; flag: {o.flag_default_text}"
        text = o.help
        if o.choices:
            text += "; one of " + ", ".join(_code(c) for c in o.choices)
        cells = (_code(o.name), flag, o.type.__name__, default, text)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
