"""The signing key (anyrec.signing): resolved once from a file or the environment, refused in one line
when unusable; a signature covers the whole document."""

from __future__ import annotations

import pytest

from anyrec.signing import FIELD, KEY_ENV, SignatureError, SigningKey, resolve_key

SECRET = "0123456789abcdef0123"


def test_no_key_anywhere_means_no_signing(tmp_path):
    """No key configured and no per-user key that can be made (its folder cannot be created): nothing is
    signed (checksums then catch damage only, said once)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert resolve_key(None, {"ANYREC_CACHE_DIR": str(blocker / "cache")}) is None


def test_the_key_file_comes_before_the_environment(tmp_path):
    f = tmp_path / "key"
    f.write_text("file-secret-of-enough-bytes\n")
    key = resolve_key(str(f), {KEY_ENV: SECRET})
    assert key.secret == b"file-secret-of-enough-bytes" and key.source == str(f)
    assert resolve_key(None, {KEY_ENV: SECRET}).source == KEY_ENV
    assert SECRET not in repr(key)  # the secret never prints


@pytest.mark.parametrize(("content", "message"), [(None, "cannot read it"), ("short", "shorter than 16"),
                                                  ("x" * 5000, "larger than 4096")])
def test_an_unusable_key_file_is_one_line(tmp_path, content, message):
    f = tmp_path / "key"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        resolve_key(str(f), {})
    assert "\n" not in str(e.value) and "trainer.signing_key_file" in str(e.value)


def test_a_signature_covers_every_field():
    key = SigningKey(SECRET.encode(), "test")
    doc = key.signed({"losses": [0.7, 0.6], "meta": {"torch": "2.13"}})
    key.check(doc, "doc")
    for edit in ({"losses": [0.7, 0.5]}, {"meta": {"torch": "2.14"}}, {"extra": 1}):
        with pytest.raises(SignatureError, match="does not match"):
            key.check({**doc, **edit}, "doc")
    with pytest.raises(SignatureError, match="does not match"):
        SigningKey(b"another-key-of-16-bytes", "other").check(doc, "doc")
    with pytest.raises(SignatureError, match="is not signed"):
        key.check({k: v for k, v in doc.items() if k != FIELD}, "doc")
