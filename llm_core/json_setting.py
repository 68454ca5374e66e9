"""A setting given as a JSON object: a flag's text (``--override-generation-config '{"temperature":
0.6}'``, ``--limit-mm-per-prompt '{"image": 4}'``) or, from a YAML / JSON config file, a mapping
already. One reading for every such setting, so each refuses the same things the same way: text
over a size bound, text that is not JSON, a value that is not an object, and keys outside the set
the setting knows (a typo would otherwise be ignored without a word). Each setting then checks its
own values."""

from __future__ import annotations

import json
from typing import Any, Collection, Mapping


def json_object_setting(value: str | Mapping[str, Any], what: str, *, known: Collection[str],
                        noun: str = "key", max_chars: int | None = None, example: str = "",
                        error: type[ValueError] = ValueError) -> dict[str, Any]:
    """``value`` as a dict whose keys are all in ``known``; else ``error`` naming ``what`` (the
    setting), ``noun`` (what its keys are), and ``example`` (a well-formed value, when given)."""
    if isinstance(value, Mapping):
        data: Any = dict(value)
    else:
        if max_chars is not None and len(value) > max_chars:
            raise error(f"{what} is over {max_chars} characters")
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            raise error(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        like = f" like {example}" if example else ""
        raise error(f"{what} must be a JSON object{like}, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise error(f"{what}: unknown {noun}(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return data
