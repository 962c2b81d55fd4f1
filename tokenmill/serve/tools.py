"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

- `none`: the tools are not shown to the model and no call is made;
- `auto` (needs `--enable-auto-tool-choice --tool-call-parser NAME`): the model decides;
  the parser finds its calls in the text;
- `required`: the output is constrained by a grammar to a JSON array of calls, each
  `{"name": <one of the tools>, "parameters": <that tool's parameters schema>}` (at most one
  without `parallel_tool_calls`), so every call is valid JSON for its function;
- a named function: the output is constrained to that function's parameters schema.

Models whose chat template ignores `tools` (SmolLM2's) get tokenmill's shipped ChatML
template with Hermes-style tool calls; `--chat-template` replaces the model's template for
every request.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.serve.errors import bad_request
from tokenmill.serve.reasoning import ReasoningParser, ReasoningStream
from tokenmill.serve.tool_parsers import TOOL_PARSERS, ToolCall, get_tool_parser
from tokenmill.serve.tool_parsers.base import ToolCallStream, ToolParser, arguments_text, new_call_id

TEMPLATES = Path(__file__).parent / "templates"
SHIPPED_TOOL_TEMPLATE = "tool_chat_template_chatml_hermes"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class AgentSettings:
    """The server's agent flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    chat_template: str | None = None  # template text (read from --chat-template)
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             f"({', '.join(sorted(TOOL_PARSERS))})")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            from tokenmill.serve.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)


def add_agent_args(parser) -> None:
    group = parser.add_argument_group("agent APIs (tool calling, reasoning)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide to call tools (tool_choice "auto"; needs --tool-call-parser)')
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="format of the model's tool calls in its text")
    group.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                       help="split <think>...</think> from the answer into reasoning_content")


def agent_settings_from_args(args) -> AgentSettings:
    return AgentSettings(
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
    )


def load_chat_template(value: str | None) -> str | None:
    """A shipped template's name, a file path, or None."""
    if value is None:
        return None
    shipped = TEMPLATES / f"{value}.jinja"
    if shipped.is_file():
        return shipped.read_text()
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat-template {value!r} is neither a file nor a shipped template "
                         f"({SHIPPED_TOOL_TEMPLATE})")
    return path.read_text()


def shipped_tool_template() -> str:
    return (TEMPLATES / f"{SHIPPED_TOOL_TEMPLATE}.jinja").read_text()


def template_handles_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and "tool_call" in template


# ----- a request's tool plan ---------------------------------------------------------------


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required", "named"
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the template sees them
    function: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None  # auto

    @property
    def shows_tools(self) -> bool:
        return self.mode != "none" and bool(self.tools)


def plan_tools(tools: list[ToolDef] | None, choice: Any, parallel: bool | None,
               settings: AgentSettings) -> ToolPlan:
    """Validate `tools` and `tool_choice` (400 naming the field) and decide the mode."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    names = []
    for index, tool in enumerate(tools):
        name = tool.function.name
        if not _NAME.match(name):
            raise bad_request(f"tools[{index}].function.name {name!r} is not a valid name (letters, digits, _ and "
                              "-, at most 64)", param="tools")
        if name in names:
            raise bad_request(f"tools[{index}].function.name {name!r} is given twice", param="tools")
        names.append(name)
    dicts = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", dicts)
    if choice == "auto":
        if not settings.enable_auto_tool_choice:
            raise bad_request('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser; send tool_choice "required" or a named function instead',
                              param="tool_choice")
        return ToolPlan("auto", dicts, parser=get_tool_parser(settings.tool_call_parser))
    if choice == "required":
        definitions: dict[str, Any] = {}
        items = [{"type": "object", "properties": {
                      "name": {"const": t.function.name},
                      "parameters": _lift_definitions(_parameters(t), f"{t.function.name}.", definitions)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if definitions:
            schema["$defs"] = definitions
        if parallel is False:
            schema["maxItems"] = 1
        return ToolPlan("required", dicts, constraint=StructuredOutputsParams(json=schema))
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"({', '.join(names)})", param="tool_choice")
    tool = tools[names.index(name)]
    return ToolPlan("named", dicts, function=name, constraint=StructuredOutputsParams(json=_parameters(tool)))


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _lift_definitions(parameters: dict[str, Any], prefix: str, definitions: dict[str, Any]) -> dict[str, Any]:
    """A parameters schema nested in the `required` schema keeps its `$defs` (or
    `definitions`, as pydantic writes them) working: they move to the root's `$defs`
    under `prefix` (the function's name, so two tools' definitions cannot collide) and
    every `#/$defs/...` reference to them is rewritten."""
    moved = {f"#/{key}/{name}": f"#/$defs/{prefix}{name}" for key in ("$defs", "definitions")
             if isinstance(parameters.get(key), dict) for name in parameters[key]}
    if not moved:
        return parameters

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: rewrite(value) for key, value in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            for old, new in moved.items():
                if ref == old or ref.startswith(old + "/"):
                    out["$ref"] = new + ref[len(old):]
        return out

    for key in ("$defs", "definitions"):
        for name, definition in (parameters.get(key) or {}).items():
            definitions[f"{prefix}{name}"] = rewrite(definition)
    return rewrite({key: value for key, value in parameters.items() if key not in ("$defs", "definitions")})


# ----- output -> tool calls ----------------------------------------------------------------


def calls_of(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished choice's (content, tool calls) under the plan."""
    if plan.mode == "named":
        return None, [ToolCall(plan.function, arguments_text(text))]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # cut by max_tokens: the calls that were completed
            items = _complete_items(text)
            if not items:
                return text, []
        return None, [ToolCall(item["name"], arguments_text(item["parameters"])) for item in items]
    if plan.mode == "auto":
        return plan.parser.extract(text)
    return text, []


class ConstrainedCallStream:
    """Streamed deltas for `named` (the text is the arguments: streamed as argument
    fragments after a first delta with the id and name) and `required` (a JSON array of
    calls: each call is sent as it completes)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.started = False
        self.num_sent = 0
        self.call_id = new_call_id()

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        self.text += delta
        if self.plan.mode == "named":
            out = []
            if not self.started and (delta or final):
                self.started = True
                out.append({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                            "function": {"name": self.plan.function, "arguments": ""}}]})
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        items = _complete_items(self.text)
        out = []
        for index in range(self.num_sent, len(items)):
            call = ToolCall(items[index]["name"], arguments_text(items[index]["parameters"]))
            out.append({"tool_calls": [{"index": index, **call.to_openai()}]})
        self.num_sent = len(items)
        return out


def _complete_items(text: str) -> list[dict[str, Any]]:
    """The complete objects of a JSON array being written (string-aware bracket scan)."""
    items, depth, start, in_string, escaped = [], 0, None, False, False
    for position, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth == 2 and char == "{":
                start = position
        elif char in "]}":
            if depth == 2 and char == "}" and start is not None:
                try:
                    items.append(json.loads(text[start:position + 1]))
                except json.JSONDecodeError:
                    pass
                start = None
            depth -= 1
    return items


# ----- one choice's output: reasoning, then content or tool calls --------------------------


class ChoiceOutput:
    """A chat choice's text -> OpenAI message fields, whole (`message`) or as stream
    deltas (`feed`): the reasoning parser first (if any), then the tool plan."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self.plan = plan
        self.reasoning_parser = reasoning
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self.tools: ToolCallStream | ConstrainedCallStream | None = None
        if plan.mode == "auto":
            self.tools = ToolCallStream(plan.parser)
        elif plan.mode in ("named", "required"):
            self.tools = ConstrainedCallStream(plan)
        self.called = False

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        pieces = self.reasoning.feed(text, final) if self.reasoning is not None else [("content", text)]
        deltas = [{"reasoning_content": piece} for kind, piece in pieces if kind == "reasoning_content"]
        content = "".join(piece for kind, piece in pieces if kind == "content")
        if self.tools is not None:
            if content or final:
                deltas += self.tools.feed(content, final)
        elif content:
            deltas.append({"content": content})
        self.called = self.called or any("tool_calls" in d for d in deltas)
        return deltas

    def message(self, text: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant"}
        content: str | None = text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract(text)
            message["reasoning_content"] = reasoning
        content, calls = calls_of(self.plan, content or "")
        message["content"] = content if content or not calls else None
        if self.reasoning_parser is None and message["content"] is None and not calls:
            message["content"] = ""
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
            self.called = True
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model chose to call (auto, required); a forced
        named call ends with "stop", as OpenAI's does."""
        if reason == "stop" and self.called and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason
