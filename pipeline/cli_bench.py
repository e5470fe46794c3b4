"""`gpufeed bench …`, `gpufeed advise`, `gpufeed estimate-memory`: measuring and advising (SPEC §3)."""

from __future__ import annotations

from .cli import main  # noqa: F401
