"""Chat templates other than the model's own: the server's --chat-template (a checkpoint may
have none, or one its users replace), and a request's `chat_template` where the server trusts
requests with one (--trust-request-chat-template): a template is Jinja code the server runs."""

from __future__ import annotations

from pathlib import Path

import jinja2
import jinja2.meta

# Characters a template has and a file name hardly ever does (vLLM reads the flag the same way).
TEMPLATE_CHARACTERS = "{}\n"


def load_chat_template(value: str) -> str:
    """--chat-template's text: the file it names, or the value itself when it reads as a template."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(character in value for character in TEMPLATE_CHARACTERS):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def template_variables(template: str | dict | None) -> frozenset[str]:
    """The variables a chat template reads (of its default, where a tokenizer names several)."""
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        return frozenset()
    environment = jinja2.Environment()
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()  # rendering will say what is wrong with it
