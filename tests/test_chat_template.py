"""Chat templates render in a sandbox with time and size limits: hostile templates are
refused with ValueError within their time budget, message content is never code."""

from __future__ import annotations

import time

import pytest

from tokenmill.chat_template import RenderLimits, render_chat_template

LIMITS = RenderLimits(seconds=1.0, max_chars=1_000_000)
HI = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "nested range loops": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over a string": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "loops with a filter and a recursive flag": (
        "{% for a in range(100000) if a >= 0 %}{% for b in (range(100000)|list) %}{% endfor %}{% endfor %}"),
    "string repetition": "{{ 'x' * 10**9 }}",
    "list repetition": "{{ [1] * 10**9 }}",
    "namespace doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "macro doubling": "{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n else s|length }}{% endmacro %}{{ f('x', 60) }}",
    "percent width": "{{ '%0999999999d' % 1 }}",
    "format width": "{{ '{:>999999999}'.format('x') }}",
    "format filter width": "{{ '%*d'|format(999999999, 1) }}",
    "center width": "{{ 'x'|center(999999999) }}",
    "replace blow-up": "{% set s = 'x' * 1000 %}{{ s|replace('', s)|replace('', s) }}",
    "tojson indent": "{{ messages|tojson(indent=999999999) }}",
    "huge power": "{{ 10 ** 100000000 }}",
    "endless recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "code execution": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "import through globals": "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('true') }}",
    "mutating a list": "{% set l = [] %}{{ l.append(1) }}",
}


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_templates_are_refused_within_the_budget(source):
    started = time.monotonic()
    with pytest.raises(ValueError, match="chat template"):
        render_chat_template(source, {"messages": HI}, LIMITS)
    assert time.monotonic() - started < LIMITS.seconds + 2.0


def test_message_content_is_data_not_code():
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    content = "{{ 7 * 7 }} {% for i in range(10**9) %}{% endfor %} {{ ''.__class__ }}"
    rendered = render_chat_template(template, {"messages": [{"role": "user", "content": content}]}, LIMITS)
    assert rendered == f"[user] {content}\n"


def test_ordinary_templates_still_render():
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages if m.role == 'user' %}{% set ns.n = ns.n + 1 %}"
        "{{ loop.index }}:{{ m.content|trim|center(9) }}|{{ '%03d' % loop.index }}{% endfor %}"
        "{{ ns.n }}{{ messages|tojson(indent=1)|length > 0 }}{{ '{:>4}'.format('x') }}"
    )
    messages = [{"role": "user", "content": " a "}, {"role": "system", "content": "s"}, {"role": "user", "content": "b"}]
    assert render_chat_template(template, {"messages": messages}, LIMITS) == (
        "1:    a    |0012:    b    |0022True   x")


def test_a_long_but_honest_conversation_fits():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    messages = [{"role": "user", "content": "word " * 20}] * 5000
    assert len(render_chat_template(template, {"messages": messages}, LIMITS)) == 5000 * (len("word ") * 20 + 10)


# Issue 31: with --trust-request-chat-template these built 1-2.4 GB strings (a 2 GB string
# answered 200, the server's RSS peaked at 6.7 GB) or froze a render for 12.7 s. Each is
# now refused before the big value exists; tracemalloc sees the render's own allocations.
ESCAPES = {
    "format filter of a list of references": (
        "{% set a = 'x' * 4000000 %}{% set l = [a] * 500 %}{% set b = '%s'|format(l) %}{{ b|length }}"),
    "format filter of many arguments": "{% set a = 'x' * 800000 %}{{ '%s%s%s%s%s%s%s%s%s%s'|format(a,a,a,a,a,a,a,a,a,a) }}",
    "~ concatenation kept with set": (
        "{% set a = 'x' * 800000 %}{% set b = a ~ a %}{% set c = b ~ b %}{% set d = c ~ c %}{% set e = d ~ d %}"
        "{% set f = e ~ e %}{% set g = f ~ f %}{% set h = g ~ g %}{{ h|length }}"),
    "integer squaring": "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}"
                        "{{ ns.n > 5 }}",
    "integer squaring with set": "{% set a = 7 ** 20000 %}{% set b = a * a %}{% set c = b * b %}{{ c > 0 }}",
    "a captured block": "{% set a = 'x' * 800000 %}{% set b %}{% for i in range(3000) %}{{ a }}{% endfor %}{% endset %}"
                        "{{ b|length }}",
    "the output of a list of references": "{% set a = 'x' * 800000 %}{{ [a] * 3000 }}",
    "join of a list of references": "{% set a = 'x' * 800000 %}{{ ([a] * 3000)|join|length }}",
}


@pytest.mark.parametrize("name", ESCAPES)
def test_every_string_and_integer_a_template_builds_is_in_the_budget(name):
    source = ESCAPES[name]
    import tracemalloc

    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ValueError, match="chat template") as refused:
            render_chat_template(source, {"messages": HI}, LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
        if name.startswith("integer"):  # refused by its size, not once the deadline passed
            assert "integer" in str(refused.value), refused.value
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < LIMITS.seconds + 2.0
    assert peak < 8 * LIMITS.max_chars, f"{peak / 2**20:.0f} MiB allocated"


def test_the_budget_leaves_ordinary_concatenation_blocks_and_formats_alone():
    template = ("{% set greeting %}Hello {{ messages[0].content }}{% endset %}{% set n = 12 * 12 %}"
                "{{ greeting ~ '!' ~ n }} {{ '%s=%d'|format('n', n) }} {{ ['a', 'b']|join('+') }}")
    assert render_chat_template(template, {"messages": HI}, LIMITS) == "Hello hi!144 n=144 a+b"
