"""Apps: registered by the device owner, each with a bearer token (stored hashed) and a quota."""

from __future__ import annotations

from lorad.server.auth import hash_token, new_token
from lorad.server.records import App, Quota
from lorad.server.store.apps import AppRepo


class AppRegistry:
    """The owner's operations on apps; servicers call these instead of the store."""

    def __init__(self, repo: AppRepo) -> None:
        self._repo = repo

    def register(self, app_id: str, display_name: str, quota: Quota) -> tuple[App, str]:
        """Creates the app and returns it with its new token (shown once; only its hash is stored)."""
        token = new_token()
        return self._repo.create(app_id, display_name, hash_token(token), quota), token

    def list_page(self, size: int, token: str) -> tuple[list[App], str]:
        """One page of apps and the next page token ("" at the end)."""
        return self._repo.list_page(size, token)

    def revoke(self, app_id: str) -> None:
        """Revokes the app's token: its calls fail from now on."""
        self._repo.revoke(app_id)

    def get(self, app_id: str) -> App:
        """One app with its usage now (NotFound otherwise)."""
        return self._repo.get(app_id)

    def rotate(self, app_id: str) -> str:
        """Replaces the app's token and returns the new one; the old one fails from now on."""
        token = new_token()
        self._repo.rotate(app_id, hash_token(token))
        return token

    def is_revoked(self, app_id: str) -> bool:
        """Whether the app was revoked (streams end when their app is)."""
        return self._repo.get(app_id).revoked
