"""Tamper evidence for the files anyrec reads back: an HMAC-SHA256 signature with a key the user holds.

Checksums only detect damage: whoever can write a file can recompute its checksum. Checkpoint manifests,
calibration cache entries and parity records are signed when written and refused, in one line, when
read back unsigned or signed with another key. The key is `trainer.signing_key_file`, else
`$ANYREC_SIGNING_KEY`, else a per-user key anyrec creates on first use in its private cache folder
(`signing.key`, mode 0600). It is resolved once at the entry point (`resolve_key`) and handed down as a
`SigningKey`; where no key can be had at all, readers say once that checksums catch damage only.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KEY_ENV = "ANYREC_SIGNING_KEY"
CACHE_DIR_ENV = "ANYREC_CACHE_DIR"  # anyrec's private cache folder (default ~/.cache/anyrec)
USER_KEY_FILE = "signing.key"  # the per-user key, in that folder
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
                                 "refused (altered after signing, or signed with another key: hosts and "
                                 "users sharing files need one key, see docs/security.md)")


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: `doc` without its signature, as sorted compact JSON."""
    body = {k: v for k, v in doc.items() if k != FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """anyrec's cache folder: `$ANYREC_CACHE_DIR`, else `~/.cache/anyrec`."""
    return Path(environ.get(CACHE_DIR_ENV) or "~/.cache/anyrec").expanduser()


def resolve_key(key_file: str | None, environ: Mapping[str, str] = os.environ) -> SigningKey | None:
    """The signing key: `key_file` (trainer.signing_key_file) if set, else `$ANYREC_SIGNING_KEY`, else the
    per-user key in the cache folder (created on first use), else None when that cannot be created
    (checksums then detect damage, not forgery). ValueError in one line if a key is unusable."""
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
        return user_key(cache_dir(environ))
    if len(secret) < MIN_KEY_BYTES:
        raise ValueError(f"{what}: the signing key is shorter than {MIN_KEY_BYTES} bytes "
                         "(e.g. `openssl rand -hex 32` makes one)")
    return SigningKey(secret, source)


def user_key(directory: Path) -> SigningKey | None:
    """The per-user key `directory/signing.key`, created (mode 0600, in a folder created 0700) if absent;
    None when it cannot be created (a read-only home). ValueError in one line for a key file that is a
    link, not a regular file, not the user's own, open to others or too short."""
    path = directory / USER_KEY_FILE
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.is_symlink() and not path.exists():
            _create_key(path)
    except OSError as e:
        logger.debug("no per-user signing key at %s: %s", path, e)
        return None
    what = f"the per-user signing key {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else f"cannot read it ({e.strerror})"
        raise ValueError(f"{what}: {why}: refused (remove it; anyrec creates a new one)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what}: not a regular file: refused")
        if st.st_uid != os.geteuid():
            raise ValueError(f"{what}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): "
                             f"refused (set {KEY_ENV} or trainer.signing_key_file, or another "
                             f"{CACHE_DIR_ENV})")
        if st.st_mode & 0o077:
            raise ValueError(f"{what}: others may read or write it (mode {stat.S_IMODE(st.st_mode):o}): "
                             f"refused (chmod 600 it, or remove it and anyrec creates a new one)")
        secret = f.read(MAX_KEY_FILE_BYTES + 1).strip()
    if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_FILE_BYTES:
        raise ValueError(f"{what}: holds {len(secret)} bytes, not a key of {MIN_KEY_BYTES} to "
                         f"{MAX_KEY_FILE_BYTES}: refused (remove it; anyrec creates a new one)")
    return SigningKey(secret, what.removeprefix("the "))


def _create_key(path: Path) -> None:
    """Write a new random key to `path`, whole or not at all: a private temporary file linked into place
    (a process that loses the race to another leaves the winner's key)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if the name exists, link or not: never replaces a file
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


_warned_unkeyed = False


def warn_unkeyed(what: str) -> None:
    """Say once per process that `what` is checked without a signing key (damage only, not forgery)."""
    global _warned_unkeyed
    if not _warned_unkeyed:
        _warned_unkeyed = True
        logger.warning("%s is checked without a signing key (none set, and no per-user key could be "
                       "created): checksums catch damage only, not forgery (docs/security.md)", what)
