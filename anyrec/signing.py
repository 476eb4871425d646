"""Tamper evidence for the files anyrec reads back: an HMAC-SHA256 signature with a key the user holds.

Checksums only detect damage: whoever can write a file can recompute its checksum. With a key
(`ANYREC_SIGNING_KEY`, or the file named by `trainer.signing_key_file`), checkpoint manifests,
calibration cache entries and parity records are signed when written and refused, in one line, when
read back unsigned or signed with another key. The key is resolved once at the entry point
(`resolve_key`) and handed down as a `SigningKey`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEY_ENV = "ANYREC_SIGNING_KEY"
FIELD = "hmac_sha256"  # where a signed JSON or YAML document keeps its signature
MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096


class SignatureError(ValueError):
    """A document that must be signed is not, or its signature does not match the key."""


@dataclass(frozen=True)
class SigningKey:
    """A secret for HMAC-SHA256 and where it came from (the secret never prints)."""

    secret: bytes = field(repr=False)
    source: str

    def sign(self, doc: Mapping[str, Any]) -> str:
        """The signature of `doc` (its `hmac_sha256` field aside)."""
        return hmac.new(self.secret, canonical(doc), hashlib.sha256).hexdigest()

    def signed(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """`doc` with its signature as the last field."""
        body = {k: v for k, v in doc.items() if k != FIELD}
        return {**body, FIELD: self.sign(body)}

    def check(self, doc: Mapping[str, Any], what: str) -> None:
        """SignatureError (one line naming `what`) unless `doc` carries this key's signature."""
        theirs = doc.get(FIELD)
        if not isinstance(theirs, str):
            raise SignatureError(f"{what} is not signed, and a signing key is set ({self.source}): "
                                 "refused (it was written without the key, or its signature was removed)")
        if not hmac.compare_digest(theirs, self.sign(doc)):
            raise SignatureError(f"{what}: its signature does not match the signing key ({self.source}): "
                                 "refused (altered after signing, or signed with another key)")


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: `doc` without its signature, as sorted compact JSON."""
    body = {k: v for k, v in doc.items() if k != FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def resolve_key(key_file: str | None, environ: Mapping[str, str] = os.environ) -> SigningKey | None:
    """The signing key: `key_file` (trainer.signing_key_file) if set, else `$ANYREC_SIGNING_KEY`, else
    None (no signatures: checksums then detect damage, not forgery). ValueError in one line if unusable."""
    if key_file:
        p = Path(key_file).expanduser()
        what = f"trainer.signing_key_file {p}"
        try:
            with p.open("rb") as f:
                secret = f.read(MAX_KEY_FILE_BYTES + 1).strip()
        except OSError as e:
            raise ValueError(f"{what}: cannot read it ({e.strerror or type(e).__name__})") from None
        if len(secret) > MAX_KEY_FILE_BYTES:
            raise ValueError(f"{what}: larger than {MAX_KEY_FILE_BYTES} bytes; a key file holds one key")
        source = str(p)
    elif environ.get(KEY_ENV):
        secret, what, source = environ[KEY_ENV].strip().encode(), KEY_ENV, KEY_ENV
    else:
        return None
    if len(secret) < MIN_KEY_BYTES:
        raise ValueError(f"{what}: the signing key is shorter than {MIN_KEY_BYTES} bytes "
                         "(e.g. `openssl rand -hex 32` makes one)")
    return SigningKey(secret, source)
