"""From a chat request's `response_format` to the grammar its choices are decoded under
(constrained.py): "text" (the default) leaves them free, "json_object" makes each reply a JSON
object, "json_schema" a JSON value valid against the schema. A schema the grammar library cannot
compile is a 400 that names the schema and what the library refused in it.
"""

from __future__ import annotations

from .constrained import Grammar, GrammarCompiler, UnsupportedGrammar
from .errors import ApiError
from .openai_schema import ResponseFormat

__all__ = ["response_grammar"]


def response_grammar(compiler: GrammarCompiler, response_format: ResponseFormat | None) -> Grammar | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return compiler.json_object()
    schema = response_format.json_schema
    try:
        return compiler.json_schema(schema.json_schema, strict=bool(schema.strict))
    except UnsupportedGrammar as exc:
        raise ApiError.invalid(f"response_format: the JSON schema {schema.name!r} cannot be used for constrained "
                               f"decoding: {exc}", "response_format") from None
