"""Chat templates: Jinja rendered in a sandbox with limits on time and size.

The environment is the one transformers uses (ImmutableSandboxedEnvironment: no access
to private attributes, no mutation of lists and dicts, `range` capped at 100,000), with
transformers' helpers (`raise_exception`, `strftime_now`, a `tojson` that does not
HTML-escape, the `{% generation %}` tag). Message content is data: it is never parsed as
template code, so "{{ 7*7 }}" in a message comes out as written.

The sandbox stops code execution, not waste. A template can still loop for hours
(nested loops over `range` or over long strings) or build huge strings (`"x" * 10**9`,
a namespace variable doubled in a loop, "%0999999999d" formatting). A model's own
template does none of that, but a server that renders templates sent by clients (vLLM's
`--trust-request-chat-template`) must not hang or run out of memory for one, so every
render runs under a `RenderBudget`:
  - a deadline, checked at every loop iteration (each `for` loop's iterable is wrapped),
    every call, attribute or item lookup and every output chunk;
  - a size limit on every string or list that binary operators, calls, filters and
    namespace assignments produce, checked before the big allocations where the size
    can be known in advance (`*`, `+`, `**`, format widths, `center`, `indent`), and on
    the rendered text.
A render that breaks a limit raises ValueError, like any other template error.
"""

from __future__ import annotations

import json
import operator
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.lexer import Token, TokenStream
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# Names the caller sets itself; template kwargs must not pass them again.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "chat_template"})


@dataclass(frozen=True)
class RenderLimits:
    seconds: float = 5.0  # wall time of one render
    max_chars: int = 8 * 2**20  # any string or list a template builds, and the output


DEFAULT_LIMITS = RenderLimits()
# Integers a template computes: squaring in a loop made 12.7 s renders (issue 31); 65,536
# bits is ~20,000 digits, past what str() converts anyway.
MAX_INT_BITS = 65_536


class TemplateLimitError(jinja2.TemplateError):
    """A render went over its time or size budget."""


class _Budget:
    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template took longer than {self.limits.seconds:g} s to render")

    def check_size(self, size: int, what: str) -> None:
        if size > self.limits.max_chars:
            raise TemplateLimitError(
                f"the chat template built {what} of {size} items, over the limit of {self.limits.max_chars}"
            )

    def check_value(self, value: Any, what: str = "a value") -> Any:
        if isinstance(value, (str, list, tuple, dict)):
            self.check_size(len(value), what)
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"the chat template built an integer of more than {MAX_INT_BITS} bits")
        return value

    def check_text(self, values: Iterable[Any], what: str) -> None:
        """Refuse before it is built: the text `values` would make as strings (a list of
        10,000 references to one 1 MB string is small, its text 10 GB)."""
        self.check_size(_text_size(values, self.limits.max_chars), what)


_budget: ContextVar[_Budget] = ContextVar("chat_template_budget")


def _current() -> _Budget:
    budget = _budget.get(None)
    if budget is None:  # rendered outside render_chat_template (tests): default limits
        budget = _Budget(DEFAULT_LIMITS)
        _budget.set(budget)
    return budget


def _text_size(value: Any, limit: int) -> int:
    """About how many characters `value` makes as text (str() of it; containers: their
    items' texts), counting no further than just past `limit`."""
    pending = [value]
    size = 0
    while pending and size <= limit:
        item = pending.pop()
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            size += 2 + 2 * len(item)
            pending.extend(item)
        elif isinstance(item, dict):
            size += 2 + 4 * len(item)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, int):
            size += item.bit_length() // 3 + 1
        else:
            size += 32
    return size


def _checked_concat(pieces: Iterable[str]) -> str:
    """`environment.concat`: joins what `{% set x %}...{% endset %}`, macros, `caller()`
    and `{% filter %}` blocks captured; sized before the join."""
    pieces = list(pieces)
    budget = _current()
    budget.tick()
    budget.check_size(sum(len(p) for p in pieces), "a captured block")
    return "".join(pieces)


def _checked_str_join(values: Iterable[Any]) -> str:
    """The `~` operator: sized before the strings are made and joined."""
    values = list(values)
    budget = _current()
    budget.tick()
    budget.check_text(values, "a ~ concatenation")
    return "".join(str(v) for v in values)


def _checked_output(value: Any) -> Any:
    """`finalize`: a `{{ value }}` is sized before it is turned into text."""
    _current().check_text([value], "an output")
    return value


# ----- rendering ---------------------------------------------------------------------------


def render_chat_template(source: str, variables: dict[str, Any], limits: RenderLimits = DEFAULT_LIMITS) -> str:
    """Render `source` with `variables`; ValueError for a template that does not compile,
    raises (raise_exception), breaks the sandbox's rules or goes over `limits`."""
    template = compile_chat_template(source)
    budget = _Budget(limits)
    token = _budget.set(budget)
    try:
        pieces: list[str] = []
        size = 0
        for piece in template.generate(**variables):
            size += len(piece)
            budget.check_size(size, "an output")
            budget.tick()
            pieces.append(piece)
        return "".join(pieces)
    except jinja2.TemplateError as error:
        raise ValueError(f"chat template error: {error}") from error
    except (RecursionError, OverflowError, MemoryError, TypeError, ArithmeticError, AttributeError,
            KeyError, IndexError, ValueError) as error:
        # Mistakes in template code surface as Python errors; they are the template's, not the server's.
        raise ValueError(f"chat template error: {type(error).__name__}: {error}") from error
    finally:
        _budget.reset(token)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per template (ValueError when it does not compile)."""
    try:
        return _ENVIRONMENT.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template does not compile: {error}") from error


# ----- the environment ---------------------------------------------------------------------


_BIG_NUMBER = re.compile(r"\d{7,}")  # a format width or precision of a million or more
_MAX_WIDTH = 100_000


class _LimitedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b ~ c` to a sized join (Jinja's own is a plain join that no binop,
    call or filter hook sees: `set` chains of it built gigabyte strings)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_str_join((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """Every node that makes a string or a number is sized: binary operators, calls,
    filters, `~` (the code generator), captured blocks (`concat`), outputs (`finalize`),
    namespace assignments; integers are capped at MAX_INT_BITS."""

    intercepted_binops = frozenset({"*", "+", "%", "**", "//", "/"})
    code_generator_class = _LimitedCodeGenerator
    concat = staticmethod(_checked_concat)
    checked_str_join = staticmethod(_checked_str_join)

    def call_binop(self, context: jinja2.runtime.Context, op: str, left: Any, right: Any) -> Any:
        budget = _current()
        budget.tick()
        if op == "*":
            count, seq = (right, left) if isinstance(left, (str, list, tuple)) else (left, right)
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                budget.check_size(len(seq) * max(count, 0), "a repeated sequence")
        elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            budget.check_size(len(left) + len(right), "a concatenation")
        elif op == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and max(abs(left), 2).bit_length() * right > MAX_INT_BITS:
                raise TemplateLimitError("the chat template computed a power too large")
        elif op == "*" and isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:  # squaring in a loop
                raise TemplateLimitError(f"the chat template built an integer of more than {MAX_INT_BITS} bits")
        elif op == "%" and isinstance(left, str):
            _check_format(left, right if isinstance(right, tuple) else (right,))
        return budget.check_value(_BINOPS[op](left, right), "a result")

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _current()
        budget.tick()
        for arg in (*args, *kwargs.values()):
            budget.check_value(arg, "an argument")
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if getattr(method, "__name__", None) in ("format", "format_map") and isinstance(
                getattr(method, "__self__", None), str):
            _check_format(method.__self__, (*args, *kwargs.values()))
        result = super().call(__context, __obj, *args, **kwargs)
        return budget.check_value(result, "a call's result")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _current().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _current().tick()
        return super().getitem(obj, argument)


_BINOPS: dict[str, Callable[[Any, Any], Any]] = {
    "*": operator.mul, "+": operator.add, "%": operator.mod, "**": operator.pow,
    "//": operator.floordiv, "/": operator.truediv,
}


def _check_format(spec: str, args: Iterable[Any]) -> None:
    """Refuse a format that would pad to a huge width ("%0999999999d", "{:>999999999}")."""
    if _BIG_NUMBER.search(spec) or any(isinstance(a, int) and not isinstance(a, bool) and abs(a) > _MAX_WIDTH
                                       for a in args if "*" in spec or "{" in spec):
        raise TemplateLimitError("the chat template asked for a format width too large")


class _LoopBudget(jinja2.ext.Extension):
    """Wraps every `for` loop's iterable in `_tokenmill_loop_budget(...)`, so that each iteration
    checks the deadline: a loop body need not call or look anything up to be stopped."""

    def filter_stream(self, stream: TokenStream) -> Iterator[Token]:
        in_for = False
        depth = 0
        wrapping = False
        for token in stream:
            if token.type == "block_begin":
                in_for = False
            elif token.type == "name" and token.value == "for" and not wrapping:
                in_for = True
            elif in_for and token.type == "name" and token.value == "in" and not wrapping:
                yield token
                yield Token(token.lineno, "name", "_tokenmill_loop_budget")
                yield Token(token.lineno, "lparen", "(")
                wrapping, depth = True, 0
                continue
            elif wrapping:
                if token.type in ("lparen", "lbracket", "lbrace"):
                    depth += 1
                elif token.type in ("rparen", "rbracket", "rbrace"):
                    depth -= 1
                ends = token.type == "block_end" or (
                    depth == 0 and token.type == "name" and token.value in ("if", "recursive"))
                if ends:
                    yield Token(token.lineno, "rparen", ")")
                    wrapping = in_for = False
            yield token


def _loop_budget(iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _current()
    for count, item in enumerate(iterable):
        if count % 256 == 0:
            budget.tick()
        yield item


class _LimitedNamespace(Namespace):
    """`namespace()` whose assignments are size-checked (the one way a template can grow
    a value across loop iterations)."""

    def __setitem__(self, name: str, value: Any) -> None:
        budget = _current()
        budget.tick()
        budget.check_value(value, "a namespace value")
        super().__setitem__(name, value)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON, as transformers renders it.
    if indent is not None and not (isinstance(indent, int) and 0 <= indent <= 64):
        raise TemplateLimitError("tojson indent must be between 0 and 64")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _width_checked(name: str, filter_function: Callable[..., Any]) -> Callable[..., Any]:
    """center, indent, wordwrap...: refuse a width that would pad to a huge string."""

    def checked(value: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, int) and not isinstance(a, bool) and abs(a) > _MAX_WIDTH
               for a in (*args, *kwargs.values())):
            raise TemplateLimitError(f"the chat template asked {name} for a width too large")
        return filter_function(value, *args, **kwargs)

    checked.__dict__.update(getattr(filter_function, "__dict__", {}))  # keeps @pass_environment & co
    return checked


# Filters whose result is text made of their arguments' text.
_TEXT_FILTERS = frozenset({"format", "join", "string", "tojson", "pprint", "center", "indent", "wordwrap",
                           "truncate", "upper", "lower", "capitalize", "title", "trim", "striptags",
                           "urlencode", "urlize", "xmlattr", "escape", "e", "forceescape", "safe", "list"})


def _size_checked(name: str, filter_function: Callable[..., Any]) -> Callable[..., Any]:
    """Every filter's result is size-checked; `replace` is also estimated before it runs."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        budget = _current()
        budget.tick()
        texts = [a for a in args if isinstance(a, str)]
        if name == "replace" and len(texts) >= 3:  # (eval context,) text, old, new
            budget.check_size(len(texts[0]) * (len(texts[2]) + 1), "a replacement")
        if name in _TEXT_FILTERS:  # e.g. "%s%s"|format(a, a), [a]*500|join: sized before they run
            budget.check_text([*args, *kwargs.values()], f"the text of filter {name!r}")
        return budget.check_value(filter_function(*args, **kwargs), f"the result of filter {name!r}")

    checked.__dict__.update(getattr(filter_function, "__dict__", {}))  # keeps @pass_eval_context & co
    return checked


def _build_environment() -> jinja2.Environment:
    env = _LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, finalize=_checked_output,
        extensions=[_GenerationTag, _LoopBudget, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    for name in ("center", "indent", "wordwrap", "truncate", "format"):
        env.filters[name] = _width_checked(name, env.filters[name])
    for name, function in list(env.filters.items()):
        env.filters[name] = _size_checked(name, function)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _LimitedNamespace
    env.globals["_tokenmill_loop_budget"] = _loop_budget
    return env


_ENVIRONMENT = _build_environment()


# Gemma's chat format (Gemma 2/3 instruction-tuned models' own template), for GGUF files
# that carry none: llama.cpp likewise falls back to a built-in Gemma format for them.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
