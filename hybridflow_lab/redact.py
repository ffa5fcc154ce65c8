"""Credentials scrubbed from what the project writes: the config it gives wandb, which stores it in the run
directory and uploads it."""

from __future__ import annotations

import netrc
import os
import re
from pathlib import Path
from typing import Any

REDACTED = "<redacted>"
# a whole name or its last ``_`` part: WANDB_API_KEY, hf_token, db_password; not max_new_tokens
_SECRET_NAME = re.compile(r"(?:^|_)(?:(?:api|access|private|secret)_?key|token|secret|password|passwd|credentials?)$")
_URL_PASSWORD = re.compile(r"(://[^/:@\s]+):[^/@\s]+@")
_MIN_SECRET_CHARS = 8  # shorter values ("1", "true") would blank out ordinary text


def is_secret_name(name: str) -> bool:
    """Whether a config key or environment variable name says it holds a credential."""
    return bool(_SECRET_NAME.search(name.lower().replace("-", "_")))


def known_secrets() -> set[str]:
    """Values of this process's secret-named environment variables and the passwords in ``~/.netrc``
    (where ``wandb login`` keeps the API key)."""
    secrets = {value for name, value in os.environ.items() if is_secret_name(name)}
    try:  # named explicitly, the file is read even when its permissions are too open for netrc's own check
        hosts = netrc.netrc(str(Path.home() / ".netrc")).hosts.values()
    except (OSError, netrc.NetrcParseError):
        hosts = []
    secrets.update(password for _, _, password in hosts if password)
    return {secret for secret in secrets if len(secret) >= _MIN_SECRET_CHARS}


def redact(value: Any, secrets: set[str] | None = None) -> Any:
    """A copy of ``value`` (nested dicts, lists and strings) with the values of secret-named keys, passwords in
    URLs and every occurrence of a known secret (default: ``known_secrets()``) replaced by ``REDACTED``."""
    secrets = known_secrets() if secrets is None else secrets
    if isinstance(value, dict):
        return {key: REDACTED if isinstance(key, str) and is_secret_name(key) and item else redact(item, secrets)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(item, secrets) for item in value]
    if isinstance(value, str):
        value = _URL_PASSWORD.sub(rf"\1:{REDACTED}@", value)
        for secret in sorted(secrets, key=len, reverse=True):  # a longer secret may contain a shorter one
            value = value.replace(secret, REDACTED)
    return value
