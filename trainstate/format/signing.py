"""Opt-in authentication of generations with HMAC-SHA256.

A digest stored beside the data it describes detects accidents, not forgeries:
whoever can write the run directory can rewrite both. With a signing key, the
manager signs every manifest (which lists each file's BLAKE3/SHA-256 digest) and
every pointer, and readers refuse anything unsigned, forged or signed with
another key.

The key comes from ``CheckpointManager(signing_key=...)``, or the environment:
``TRAINSTATE_SIGNING_KEY`` (the key itself) or ``TRAINSTATE_SIGNING_KEY_FILE``
(a file holding it). It is never written to the run directory, and a key file
inside the run directory is refused. Without a key, signatures are neither
written nor checked; a manager opened without one on a signed run refuses
(:mod:`trainstate.lifecycle.keyless`) unless given ``signing_key=False``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from ..errors import CorruptGeneration, InvalidArgument, TrainStateError
from .digest import CRYPTOGRAPHIC

ENV_KEY = "TRAINSTATE_SIGNING_KEY"
ENV_KEY_FILE = "TRAINSTATE_SIGNING_KEY_FILE"
MIN_KEY_BYTES = 16


class SigningKey:
    """A secret for HMAC-SHA256. ``repr`` never shows it."""

    def __init__(self, secret: bytes | str):
        secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(secret) < MIN_KEY_BYTES:
            raise TrainStateError(f"a signing key needs at least {MIN_KEY_BYTES} bytes; got {len(secret)}")
        self._secret = secret

    def __repr__(self) -> str:
        return "SigningKey(<hidden>)"

    def sign(self, body: dict) -> str:
        """HMAC-SHA256 of ``body``'s canonical JSON, in hex."""
        return hmac.new(self._secret, canonical(body), hashlib.sha256).hexdigest()

    def check(self, body: dict, signature: object, where: str) -> None:
        """Raise :class:`CorruptGeneration` naming ``where`` unless ``signature`` is this key's for ``body``."""
        if signature is None:
            raise CorruptGeneration(where, "is not signed, but a signing key is configured; refusing it")
        if type(signature) is not str or not hmac.compare_digest(self.sign(body), signature):
            raise CorruptGeneration(where, "signature does not match: forged, altered, or signed with another key")


def canonical(body: dict) -> bytes:
    return json.dumps({k: v for k, v in body.items() if k != "signature"}, sort_keys=True,
                      separators=(",", ":")).encode()


def resolve(key: SigningKey | bytes | str | bool | None, run_directory: str | Path | None = None
            ) -> SigningKey | None:
    """The key to use: the explicit one, else the environment's, else ``None``. ``False``: none, whatever the
    environment says (the deliberate choice to save unsigned, see :func:`trainstate.lifecycle.keyless.check`)."""
    if isinstance(key, SigningKey):
        return key
    if key is False:
        return None
    if key is True:
        raise InvalidArgument("signing_key=True names no key: pass the key itself (or set "
                              f"{ENV_KEY} / {ENV_KEY_FILE}), or signing_key=False to save unsigned")
    if key is not None:
        return SigningKey(key)
    if os.environ.get(ENV_KEY):
        return SigningKey(os.environ[ENV_KEY])
    path = os.environ.get(ENV_KEY_FILE)
    if not path:
        return None
    key_path = Path(path).resolve()
    if run_directory is not None and Path(run_directory).resolve() in key_path.parents:
        raise TrainStateError(f"{ENV_KEY_FILE} points inside the run directory {run_directory}; a key stored "
                              "next to what it signs authenticates nothing. Keep it elsewhere.")
    try:
        return SigningKey(key_path.read_bytes().strip())
    except OSError as exc:
        raise TrainStateError(f"cannot read the signing key file {path}: {exc.strerror}") from None


def check_signable(algorithm: str, key: SigningKey | None) -> None:
    """A signature authenticates file contents only through a collision-resistant digest."""
    if key is not None and algorithm not in CRYPTOGRAPHIC:
        raise InvalidArgument(
            f"digest {algorithm!r} cannot back a signature: it detects corruption, but whoever can write the files "
            "can match it on purpose. Use digest='blake3-chunked' (the default when a signing key is set; a store "
            "passed as store= names its own: LocalStore(path, 'blake3-chunked')), or save without a key")
