"""Every failure answers in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

OpenAI clients read `error.message` to build their exceptions, so FastAPI's own
shapes (422 with `detail`, 404 with `detail`) are replaced here, and a client
fault is always 400, never 422.
"""

from __future__ import annotations

import logging
import re
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# OpenAI's `type` for each status this server answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to send as-is: status, message, and OpenAI's optional fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_value_error(error: ValueError) -> APIError:
    """A ValueError from the input processor (an AdmissionError names its `param`) or from
    SamplingParams, which names the field first ("temperature must be >= 0, ..."): the
    field becomes `param`."""
    message = str(error)
    param = getattr(error, "param", None)
    if param is not None:
        return bad_request(message, param=param)
    match = re.match(r"^([a-z_]+) (?:must|values|keys)\b", message)
    return bad_request(message, param=match.group(1) if match else None)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": _encodable(message), "type": error_type,
                      "param": None if param is None else _encodable(param), "code": code}}


def _encodable(text: str) -> str:
    """The text with anything UTF-8 cannot encode (a lone surrogate quoted back from the
    request) escaped, so that the error itself can always be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = describe_validation_errors(exc.errors())
    content_type = request.headers.get("content-type", "")
    if param is None and "json" not in content_type:
        # FastAPI parses JSON only when told it is JSON (curl -d says form data).
        message = f"{message}; send it with 'Content-Type: application/json' (got {content_type or 'none'!r})"
    return error_response(400, message, param)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    return internal_error_response(exc)


def internal_error_response(exc: BaseException) -> JSONResponse:
    """A 500 that says nothing of the server's insides (no exception text, which may name
    files): the log has the traceback, under the id the client is given."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("unhandled error %s while serving a request", error_id, exc_info=exc)
    return error_response(500, f"internal server error (logged as {error_id})", code="internal_error")


def describe_validation_errors(errors: Any) -> tuple[str, str | None]:
    """One readable sentence for pydantic's error list, and the field it names."""
    errors = list(errors)
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    if not loc and kind == "missing":
        return "the request body is missing: send a JSON object", None
    # Union members add their type names to the location ("prompt", "str"); drop them
    # so that `param` names the field the client sent.
    param = _field_path(first) or None
    # A value that fits no member of a union fails once per member, at the same field:
    # say what each member wanted, in one sentence.
    same_field = [e for e in errors if _field_path(e) == (param or "")]
    wanted = list(dict.fromkeys(str(e.get("msg")) for e in same_field))
    message = " or ".join(wanted)
    if param:
        message = f"{param}: {message}"
    others = len(errors) - len(same_field)
    if others:
        message += f" (and {others} more problem{'s' if others > 1 else ''})"
    return message, param


def _field_path(error: dict[str, Any]) -> str:
    """The dotted field of an error, without "body" and union member names."""
    parts = [str(part) for part in error.get("loc", ()) if part != "body"]
    return ".".join(part for part in parts if not _is_union_tag(part))


def _is_union_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part
