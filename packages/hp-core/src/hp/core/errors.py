"""Errors with a meaning for users: the CLI prints them as one line, no traceback."""

from __future__ import annotations


class HpError(Exception):
    """Base class of every error hp raises on purpose."""


class UsageError(HpError):
    """Bad input from the user (flags, config, backend names). The CLI exits with code 2."""


class UnknownBackendError(UsageError):
    """A backend name that no installed plugin provides."""

    def __init__(self, family: str, name: str, available: list[str]) -> None:
        names = ", ".join(sorted(available)) or "none installed"
        super().__init__(f"unknown {family} backend {name!r} (available: {names})")
        self.family, self.name, self.available = family, name, available


class BackendUnavailableError(UsageError):
    """A known backend that cannot run on this machine (e.g. nccl without CUDA)."""


class ControlPlaneError(HpError):
    """The controller refused a request or could not be reached."""

    def __init__(self, message: str, status: int = 0, body: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or {}
