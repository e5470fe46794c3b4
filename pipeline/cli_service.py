"""`gpufeed worker|beat|submit|status|jobs|cancel|schedule`: the Celery service (SPEC §4)."""

from __future__ import annotations

from .cli import main  # noqa: F401
