"""Chat templates: messages to one prompt string, the Hugging Face way, in a jinja2 sandbox.

The template comes from the model folder: `chat_template.jinja`, else `chat_template` in
`tokenizer_config.json` (a string, or a list of named templates of which "default" is used);
a model without one gets `FALLBACK`. Templates see `messages`, `add_generation_prompt=True`,
`bos_token`, `eos_token`, `raise_exception` and `strftime_now`, as transformers provides them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

FALLBACK = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the messages (raise_exception) or failed to render them."""


class ChatTemplate:
    """A compiled chat template and the special tokens it may use."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson  # transformers' version: no HTML escaping
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.source = source
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"cannot compile the chat template: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict]) -> str:
        """The prompt for these messages, ending where the assistant's answer begins."""
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None


def load_chat_template(model_dir: str | Path) -> ChatTemplate:
    """The model's chat template (see the module doc), or the fallback."""
    folder = Path(model_dir)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    jinja_file = folder / "chat_template.jinja"
    source = jinja_file.read_text() if jinja_file.is_file() else _named(cfg.get("chat_template"))
    return ChatTemplate(
        source or FALLBACK, _token(cfg.get("bos_token")), _token(cfg.get("eos_token"))
    )


def _named(value: str | list | None) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"...}]
        by_name = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return by_name.get("default")
    return value


def _token(value: str | dict | None) -> str:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value or ""


def _tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
