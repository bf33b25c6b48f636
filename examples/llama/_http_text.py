"""Text for the HTTP server: incremental detokenization, stop strings, chat templates.

All of it runs on the event loop, per request; the engine thread only sees token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Detokenizer", "StopText", "ChatTemplate", "load_chat_template"]

_CONTEXT = 5   # tokens decoded before the new ones (merges and leading spaces come out right)


class Detokenizer:
    """Turns generated ids into text pieces whose concatenation is the text of all of them.

    Each :meth:`add` decodes a window of a few earlier tokens plus the new ones and returns the
    text past the window's; a piece ending in an incomplete UTF-8 sequence (U+FFFD) is held
    back until the next token completes it. Special tokens are skipped.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0                 # window start
        self._read = len(self._ids)      # ids before this are already in the text

    def add(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        dec = self._tok.decode
        before = dec(self._ids[self._prefix:self._read], skip_special_tokens=True)
        now = dec(self._ids[self._prefix:], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]


class StopText:
    """The text of a request so far, cut at the first stop string.

    :meth:`add` returns ``(piece, stopped)``: the text that may be sent now (text that could be
    the start of a stop string is held back) and whether a stop string ended it; :meth:`flush`
    the held-back rest at the end.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self._sent = 0

    def add(self, piece: str) -> tuple[str, bool]:
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        cut = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if cut:
            self.text = self.text[:min(cut)]
            return self.flush(), True
        safe = max(self._sent, len(self.text) - self._hold)
        out, self._sent = self.text[self._sent:safe], safe
        return out, False

    def flush(self) -> str:
        out, self._sent = self.text[self._sent:], len(self.text)
        return out


class ChatTemplate:
    """A HF chat template (Jinja, sandboxed) rendered to a prompt string."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict[str, Any]]) -> str:
        """Raises ValueError for messages the template refuses."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None


def _raise(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _token_text(v: Any) -> str:
    if isinstance(v, dict):
        v = v.get("content", "")
    return v if isinstance(v, str) else ""


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The default chat template of ``model_dir/tokenizer_config.json`` (``chat_template``: a
    string, or a list of ``{"name", "template"}`` of which "default" or the first is taken), or
    None when there is none."""
    cfg_path = Path(model_dir) / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    source = cfg.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, _token_text(cfg.get("bos_token")),
                        _token_text(cfg.get("eos_token")))
