"""The structured output a request asks for, from any of the spellings OpenAI and vLLM accept
(response_format, structured_outputs, the guided_* fields); more than one is refused by the caller."""

from __future__ import annotations

import json

from vmkv.engine.sampling_params import StructuredOutput
from vmkv.server.errors import bad_request
from vmkv.server.protocol import SamplingFields


def structured_specs(body: SamplingFields) -> list[tuple[str, StructuredOutput | None]]:
    """Every way a request can ask for a constrained output, as (param, spec or None); an
    empty one (a "" regex, no choices) is a 400 naming its field."""
    specs: list[tuple[str, StructuredOutput | None]] = []
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        specs.append(("response_format", None))
    elif response_format.type == "json_object":
        specs.append(("response_format", StructuredOutput("json_object")))
    else:
        specs.append(("response_format", json_spec("response_format", response_format.json_schema.schema_)))
    so = body.structured_outputs
    if so is not None:
        specs += [
            ("structured_outputs.json", json_spec("structured_outputs.json", so.json_)),
            ("structured_outputs.regex", constraint("structured_outputs.regex", "regex", so.regex)),
            (
                "structured_outputs.choice",
                constraint("structured_outputs.choice", "choice", choices=so.choice),
            ),
            ("structured_outputs.grammar", constraint("structured_outputs.grammar", "grammar", so.grammar)),
            ("structured_outputs.json_object", StructuredOutput("json_object") if so.json_object else None),
        ]
    specs += [
        ("guided_json", json_spec("guided_json", body.guided_json)),
        ("guided_regex", constraint("guided_regex", "regex", body.guided_regex)),
        ("guided_choice", constraint("guided_choice", "choice", choices=body.guided_choice)),
        ("guided_grammar", constraint("guided_grammar", "grammar", body.guided_grammar)),
    ]
    return specs


def json_spec(param: str, schema: dict | str | None) -> StructuredOutput | None:
    """A JSON-schema constraint from a schema object or its JSON text (parsed later)."""
    if schema is None:
        return None
    return constraint(param, "json", schema if isinstance(schema, str) else json.dumps(schema))


def constraint(
    param: str, kind: str, spec: str | None = "", choices: list[str] | None = ()
) -> StructuredOutput | None:
    """The field's constraint, None when the field is unset, a 400 naming it when empty."""
    if spec is None or choices is None:
        return None
    try:
        return StructuredOutput(kind, spec, choices=tuple(choices))
    except ValueError as error:
        raise bad_request(f"{param} is not a valid {kind} constraint: {error}", param) from None
