"""Structured output at the HTTP edge: OpenAI's and vLLM's request fields become SGLang's sampling
fields (the grammars are then compiled on the preprocessing pool, ``Preprocessor.compile_grammars``)."""

from __future__ import annotations

import json
from typing import Any

from mmlora.server.errors import APIError

JSON_OBJECT_SCHEMA = '{"type": "object"}'


def openai_constraint(req: Any) -> tuple[dict[str, str], str]:
    """``response_format`` (json_schema, json_object, text) and vLLM's ``guided_*`` extras -> (the
    sampling fields json_schema / regex / ebnf, the request field that set them); more than one
    constraint is an error."""
    response_format, guided_json = req.response_format, req.guided_json
    guided_regex, guided_grammar = req.guided_regex, req.guided_grammar
    found: dict[str, tuple[str, str]] = {}
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise APIError(
                    400,
                    "response_format.json_schema.schema: expected a JSON schema object",
                    param="response_format",
                )
            found["response_format"] = ("json_schema", json.dumps(schema))
        elif kind == "json_object":
            found["response_format"] = ("json_schema", JSON_OBJECT_SCHEMA)
        elif kind not in (None, "text"):
            raise APIError(
                400,
                f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
                param="response_format",
            )
    if guided_json is not None:
        found["guided_json"] = (
            "json_schema",
            guided_json if isinstance(guided_json, str) else json.dumps(guided_json),
        )
    if guided_regex is not None:
        found["guided_regex"] = ("regex", guided_regex)
    if guided_grammar is not None:
        found["guided_grammar"] = ("ebnf", guided_grammar)
    if len(found) > 1:
        names = ", ".join(found)
        raise APIError(
            400, f"give at most one structured-output constraint, got {names}", param=list(found)[1]
        )
    return {kind: spec for kind, spec in found.values()}, next(iter(found), "response_format")
