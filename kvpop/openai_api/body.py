"""A request's JSON body, read under a size limit and checked before any of it reaches the engine.

The limit is enforced while reading: a declared `Content-Length` over it is refused before a byte is
read, and a body sent without one (chunked) is refused as soon as it grows past it, so a huge body
costs the API at most the limit in memory and never reaches Triton. Then the body must be UTF-8,
JSON, and hold only valid text (JSON can escape a lone surrogate, `"\\ud800"`, which UTF-8 cannot
carry); each failure is a 400 (413 for the size) with OpenAI's error body.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvpop.openai_api.errors import APIError
from kvpop.serving.contract import unencodable_at

MAX_BODY_BYTES = 4 * 2**20  # the default limit: a prompt at the engine's max_prompt_tokens is a few hundred kB

Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request, model: type[Body], max_bytes: int) -> Body:
    """The request body as `model`, or APIError (400; 413 past `max_bytes`)."""
    too_large = APIError(413, f"the request body is larger than this server's limit of {max_bytes} bytes",
                         "invalid_request_error", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > max_bytes:
            raise too_large
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError.invalid(f"the request body is not valid UTF-8 ({error.reason} at byte {error.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise APIError.invalid(f"the request body is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})",
                               code="invalid_json") from None
    except RecursionError:
        raise APIError.invalid("the request body nests too deeply", code="invalid_json") from None
    where = unencodable_at(value)
    if where is not None:
        raise APIError.invalid(f"{where or 'the body'} is not valid text: it holds a lone surrogate", where or None)
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise validation_error(error) from None


def validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, naming its field."""
    first = error.errors()[0] if error.errors() else {}
    param = ".".join(str(part) for part in first.get("loc", ())) or None
    message = first.get("msg", "invalid request body")
    return APIError.invalid(f"{param}: {message}" if param else message, param)
