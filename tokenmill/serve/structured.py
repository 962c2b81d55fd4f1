"""Request fields that constrain the output -> `StructuredOutputsParams`, compiled before
admission.

The spellings clients use, all accepted: OpenAI's `response_format` (`json_object`, and
`json_schema` with `strict`), vLLM's `structured_outputs` object, and vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be
set. The constraint is compiled here, on the server's prompt threads and bounded in time
(the compiler's timeout), so a bad or pathological one is a 400 naming the field, and the
engine thread only ever finds grammars cached.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, create_model

from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.serve.errors import APIError, bad_request


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # 0.0 is not a boolean (schemathesis: a schema-violating body accepted)


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _request_model_of(params_class: type) -> type[BaseModel]:
    """The request object for a constraint dataclass, built from its fields: their names
    (vLLM's), types and defaults, so a field is declared once, in `StructuredOutputsParams`.
    The request model checks the types; the dataclass's own checks (exactly one
    constraint, non-empty choices, ...) run when `constraint_of` builds it, as a 400
    naming the field."""
    hints = typing.get_type_hints(params_class)
    fields: dict[str, Any] = {}
    for declared in dataclasses.fields(params_class):
        if declared.metadata.get("internal"):
            continue
        # `json` would shadow BaseModel.json: stored as `json_`, read and written as `json`.
        attribute = declared.name + "_" if hasattr(BaseModel, declared.name) else declared.name
        fields[attribute] = (hints[declared.name], Field(declared.default, alias=declared.name))
    return create_model(params_class.__name__ + "Field", __base__=_Lenient, __doc__=params_class.__doc__,
                        **fields)


# vLLM's `structured_outputs` request object.
StructuredOutputsField = _request_model_of(StructuredOutputsParams)


def constraint_of(body: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from; 400 if several are set or
    one is malformed."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format: ResponseFormat | None = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            spec = response_format.json_schema
            if spec is None or spec.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  param="response_format")
            found.append(("response_format", {"json": spec.schema_}))
    field: BaseModel | None = getattr(body, "structured_outputs", None)
    if field is not None:
        found.append(("structured_outputs", field.model_dump(by_alias=True, exclude_unset=True)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise bad_request(f"set at most one output constraint; got {', '.join(n for n, _ in found)}",
                          param=found[1][0])
    param, values = found[0]
    try:
        return StructuredOutputsParams(**values), param
    except (TypeError, ValueError) as error:
        raise bad_request(str(error).replace("structured_outputs", param), param=param) from None


def compile_constraint(compiler: Any, params: StructuredOutputsParams, param: str | None) -> None:
    """Compile (or find cached) on the calling thread, bounded in time; 400 on failure."""
    from tokenmill.structured_output.compiler import StructuredOutputError

    try:
        compiler.compile_with_timeout(params)
    except StructuredOutputError as error:
        raise APIError(400, f"{param}: {error}", param=param) from None
