"""Credentials: the owner token file (0600, created at first start) and hashed per-app bearer tokens."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

from lorad.server.engine.api import atomic_write
from lorad.server.errors import PermissionDenied, Unauthenticated
from lorad.server.store.apps import AppRepo


@dataclass(frozen=True)
class Principal:
    """Who is calling: the device owner (``app_id`` is None) or one app."""

    app_id: str | None

    @property
    def is_owner(self) -> bool:
        """True for the device owner."""
        return self.app_id is None

    def require_owner(self) -> None:
        """Raises PermissionDenied unless the caller is the device owner."""
        if not self.is_owner:
            raise PermissionDenied("this method needs the device owner's token (<data_dir>/owner.token)")

    def require_app(self) -> str:
        """The caller's app id; PermissionDenied for the owner token (app-scoped methods need an app token)."""
        if self.app_id is None:
            raise PermissionDenied("this method is scoped to one app; call it with that app's token")
        return self.app_id


def new_token() -> str:
    """A fresh bearer token: 32 random bytes, 43 URL-safe characters, never starting with "-" (one in 64 did, and
    `lorad --token -x…` reads such a token as an option)."""
    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token


def hash_token(token: str) -> str:
    """SHA-256 hex of a token (tokens are 256-bit random, so an unsalted fast hash is enough)."""
    return hashlib.sha256(token.encode()).hexdigest()


def ensure_owner_token(data_dir: Path) -> str:
    """Reads ``<data_dir>/owner.token``, creating it (mode 0600, atomically) at first start.

    Returns:
        The owner token.
    """
    path = data_dir / "owner.token"
    if path.exists():
        path.chmod(0o600)  # repair a loosened mode rather than serve a world-readable credential
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    token = new_token()
    atomic_write(path, lambda f: f.write(f"{token}\n".encode()))  # the temp file is mode 0600 and path keeps it
    return token


class Authenticator:
    """Maps a bearer token to a Principal; app tokens are looked up on every call so revocation is immediate."""

    def __init__(self, owner_token: str, apps: AppRepo) -> None:
        self._owner_hash = hash_token(owner_token)
        self._apps = apps

    def authenticate(self, authorization: str | None) -> Principal:
        """Checks an ``authorization`` metadata value (``Bearer <token>``).

        Raises:
            Unauthenticated: missing, malformed, unknown or revoked token.
        """
        if not authorization:
            raise Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("malformed authorization metadata; expected 'Bearer <token>'")
        h = hash_token(token.strip())
        if hmac.compare_digest(h, self._owner_hash):
            return Principal(None)
        app_id = self._apps.app_for_token_hash(h)
        if app_id is None:
            raise Unauthenticated("unknown or revoked token")
        return Principal(app_id)
