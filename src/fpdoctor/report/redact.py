"""Secret redaction, applied to every report and facts file before it is written anywhere.

Two rules: a value whose *key* names a secret (HF_TOKEN, AWS_SECRET_ACCESS_KEY, WANDB_API_KEY,
...) is replaced whole; inside any string, URL credentials (``https://user:pass@host``), secret
``?token=`` query values, ``NAME=value`` assignments of secret names and well-known token shapes
are masked. Redaction runs on the finished dict, so no renderer or collector can forget it.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

# Key names that hold secrets. Matched as words inside an upper-cased key, so
# "HF_TOKEN", "hf_token", "GITHUB_TOKEN" and "AWS_SECRET_ACCESS_KEY" all match, but
# "TOKENIZERS_PARALLELISM" does not.
_SECRET_KEY = re.compile(
    r"(?:^|_)(TOKEN|SECRET|PASSWORD|PASSWD|PASS|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIALS?|"
    r"AUTH|AUTHORIZATION|SESSION_?KEY|SIGNATURE)(?:$|_)"
)
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/@\s:]+(?::[^/@\s]*)?)@")
_QUERY_SECRET = re.compile(
    r"(?P<key>[?&](?:access_token|token|api_key|apikey|key|sig|signature|password|secret)=)[^&#\s]+",
    re.IGNORECASE,
)
_ASSIGNMENT = re.compile(r"\b(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<sep>\s*[=:]\s*)(?P<q>[\"']?)(?P<value>[^\s\"',;]+)")
# Token shapes that are secret wherever they appear (prefixes documented by their issuers).
_TOKEN_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|"
    r"AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9_-]{20,}|xox[abpr]-[A-Za-z0-9-]{10,}|glpat-[A-Za-z0-9_-]{20,})\b"
)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(key.upper()))


def redact_text(text: str) -> str:
    """Mask credentials inside free text (log lines, URLs, pasted environment dumps)."""
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _QUERY_SECRET.sub(lambda m: f"{m['key']}{MASK}", text)

    def assignment(m: re.Match[str]) -> str:
        if is_secret_key(m["name"]) and m["value"] != MASK:
            return f"{m['name']}{m['sep']}{m['q']}{MASK}"
        return m.group(0)

    text = _ASSIGNMENT.sub(assignment, text)
    return _TOKEN_SHAPES.sub(MASK, text)


def redact(value: Any, key: str | None = None) -> Any:
    """Return a redacted deep copy of a JSON-like value."""
    if key is not None and is_secret_key(key) and isinstance(value, (str, int, float)):
        return MASK
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
