"""Keep storage passwords out of logs, user attributes, reports and exported configs."""

from __future__ import annotations

import re

# user:password@ in any URL-like string (also inside longer text such as an exception message).
_CREDENTIALS = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@\s]*)@"
)


def mask_secrets(text: str) -> str:
    """Replace the password of every `scheme://user:password@host` in `text` with `***`."""
    return _CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
