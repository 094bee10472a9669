"""JsonPrefix (launch/frontend/json_prefix.py): what it sends of a JSON value written piece by piece is always the
start of the value's final form, and all of it once the value is whole. Oracle: Python's json module, on values
and spellings the test makes at random (nesting, escapes, surrogate pairs, non-ASCII, numbers in other forms,
whitespace anywhere JSON allows it) and cut at random. And CallStream (launch/frontend/call_stream.py) reads each
piece once, keeping only the text between calls."""
from __future__ import annotations

import json
import random

import pytest

from launch.frontend.json_prefix import JsonPrefix

_CHARS = 'ab "\\/\n\t\x01é€😀\u2028'


def value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["int", "float", "str", "lit", "list", "dict"] if depth < 4 else ["int", "str", "lit"])
    if kind == "int":
        return rng.choice([0, -7, 10 ** rng.randint(0, 30)])
    if kind == "float":
        return rng.choice([0.5, -1e-9, 1.0, 2.5e40, 1 / 3])
    if kind == "str":
        return "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 8)))
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {"".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 4))) + str(i): value(rng, depth + 1)
            for i in range(rng.randint(0, 3))}


def spelled(rng: random.Random, v) -> str:
    """v written as a model might: any of json.dumps' spellings, or with random whitespace and number forms."""
    if rng.random() < 0.5:
        return json.dumps(v, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]),
                          separators=rng.choice([None, (",", ":"), (" ,", " : ")]))
    space = lambda: rng.choice(["", " ", "\n  ", "\t"])     # noqa: E731
    if isinstance(v, dict):
        return "{" + space() + ",".join(space() + json.dumps(k, ensure_ascii=rng.random() < 0.5) + space() + ":"
                                        + space() + spelled(rng, x) + space() for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + space() + ",".join(space() + spelled(rng, x) + space() for x in v) + "]"
    if isinstance(v, float) and v == 1.0:
        return rng.choice(["1.0", "1.00", "10e-1", "1E0"])
    if isinstance(v, int) and not isinstance(v, bool):
        return rng.choice([str(v), f"{v}E+0", f"{v}e-0", "-0" if v == 0 else f"{v}.000"])
    return json.dumps(v, ensure_ascii=rng.random() < 0.5)


def pieces(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("seed", range(300))
def test_what_goes_out_begins_the_final_form_and_ends_as_it(seed):
    rng = random.Random(seed)
    v = value(rng)
    text = spelled(rng, v)
    final = json.dumps(json.loads(text), ensure_ascii=False)
    after = rng.choice(["", "}", " </tool_call>", ",{"])      # what follows the value is not its
    for canonical, ascii, want in ((True, False, final), (False, False, text.strip()),
                                   (True, True, json.dumps(json.loads(text)))):
        j, sent = JsonPrefix(canonical=canonical, ascii=ascii), ""
        for p in pieces(rng, " " + text + after):
            sent += j.feed(p)
            assert want.startswith(sent), (text, sent)
        if after or isinstance(v, (str, list, dict)):     # a number or literal ends at what follows it
            assert (sent, j.done, j.end, j.failed) == (want, True, len(" " + text), False), text


@pytest.mark.parametrize("text,sent", [
    ('{"a": 1, "a": 2}', '{"a": 1, '),      # a repeated key: json.loads keeps the last value, in the first's place
    ('{"x": "\\ud800\\u00e9"}', '{"x": "'),        # a lone surrogate: the answer escapes every non-ASCII
    ('{"x": "a\nb"}', '{"x": "a'),            # a raw newline in a string is not JSON
    ('[1, 2,]', '[1, 2, '),
    ('{"a" 1}', '{"a"'),
    ('tru e', ''),
])
def test_it_stops_where_the_text_cannot_dump_back_to_what_went_out(text, sent):
    j, out = JsonPrefix(), ""
    for c in text:
        out += j.feed(c)
    assert (out, j.failed, j.done) == (sent, True, False)


def test_opens_refuses_other_values_and_raw_keeps_the_text_as_written():
    assert JsonPrefix(opens="{[").feed('"{}"') == "" and JsonPrefix(opens="{[").feed('null ') == ""
    j = JsonPrefix(canonical=False)
    assert j.feed('{"a" :1 , "a":"\\ud800"} tail') == '{"a" :1 , "a":"\\ud800"}' and j.done
    j = JsonPrefix(canonical=False)
    assert j.feed('{"zone": ') == '{"zone":'      # whitespace after a token waits for what follows
    j = JsonPrefix(ascii=True)       # harmony's form escapes every non-ASCII, a lone surrogate too
    assert j.feed('{"x": "\\ud800é"}') == '{"x": "\\ud800\\u00e9"}' == json.dumps({"x": "\ud800é"}) and j.done


def test_a_long_stream_keeps_only_the_text_between_calls():
    """Each piece is read once: a long argument goes through its reader as it comes (CallStream keeps no copy of
    it, JsonPrefix none of a raw string), text after the calls is not kept, and a call the readers do not follow
    stops the streaming once its header runs past MAX_HEADER (the rest comes whole at the end)."""
    from launch.frontend.call_stream import MAX_HEADER, READERS, CallStream
    from launch.frontend.tool_parsers import PARSERS
    for parser, text in (
            ("hermes", '<tool_call>{"name": "a", "arguments": {"code": "' + "x = 1\\n" * 3000 + '"}}</tool_call>'
             + " trailing" * 500),
            ("mistral", '[TOOL_CALLS]a[ARGS]{"code": "' + "y" * 20000 + '"}' + " trailing" * 500),
            ("glm45", "<tool_call>a<arg_key>code</arg_key><arg_value>" + "z" * 20000 + "</arg_value></tool_call>")):
        s = CallStream(READERS[PARSERS[parser]]({"a": {}}), lambda: "id")
        longest = 0
        for i in range(0, len(text), 3):
            s.add(text[i:i + 3])
            longest = max(longest, len(s.text), len(getattr(s._args, "_token", "")))
        assert longest < 64 and not s.stopped and len(s.sent) == 1, (parser, longest)
        assert len("".join(s.sent[0][1])) > 20000, parser
    s = CallStream(READERS[PARSERS["hermes"]]({}), lambda: "id")
    text = '<tool_call>{"arguments": {"code": "' + "w" * 5000 + '"}, "name": "a"}</tool_call>'
    for i in range(0, len(text), 3):
        s.add(text[i:i + 3])
        assert len(s.text) <= MAX_HEADER + 3
    assert s.stopped and s.sent == []
