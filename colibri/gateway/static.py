"""Static files from one folder, with no way out of it.

A URL path is refused outright when a segment is empty, `.` or `..`, or holds a backslash, a
colon or a NUL (the path arrives percent-decoded, so `%2e%2e` and `%2f` are caught here too).
What remains is joined to the root and resolved with symlinks followed; the real path must
still lie inside the real root, so a symlink pointing out of the folder is refused like `..`.
Extensionless GET paths that match no file fall back to `index.html` (client-side routes).
"""

from __future__ import annotations

from pathlib import Path

INDEX = "index.html"
_BAD_CHARS = ("\\", ":", "\0")


class StaticSite:
    """`lookup(url_path)`: the file to serve, or None for 404."""

    def __init__(self, root: Path | None):
        self.root = root.resolve() if root is not None and root.is_dir() else None

    def lookup(self, url_path: str) -> Path | None:
        parts = _segments(url_path)
        if parts is None or self.root is None:
            return None
        found = self._inside(self.root.joinpath(*parts))
        if found is not None and found.is_dir():
            found = self._inside(found / INDEX)
        if found is not None and found.is_file():
            return found
        if not parts or "." not in parts[-1]:  # a client-side route, not a missing asset
            index = self._inside(self.root / INDEX)
            return index if index is not None and index.is_file() else None
        return None

    def _inside(self, path: Path) -> Path | None:
        """The real path if it exists and lies inside the root, else None."""
        assert self.root is not None
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):  # missing, or a symlink loop
            return None
        return real if real == self.root or real.is_relative_to(self.root) else None


def _segments(url_path: str) -> list[str] | None:
    """The path's segments below the root, or None when any segment is unsafe."""
    if not url_path.startswith("/"):
        return None
    parts = url_path[1:].split("/")
    if parts and parts[-1] == "":  # a trailing slash: the folder itself
        parts.pop()
    for p in parts:
        if p in ("", ".", "..") or any(c in p for c in _BAD_CHARS):
            return None
    return parts
