"""The import hook `gpufeed watch` puts first on the watched command's PYTHONPATH.

    sitecustomize.py       runs at every Python start-up under watch: starts the recorder, then runs
                           the sitecustomize it hides (if any)
    gpufeed_watch_hook.py  the recorder: times each torch DataLoader iterator's `__next__`, each gpufeed
                           Loader iteration and each DataLoader fetch (in the workers), per loader, and
                           appends the running totals as JSON lines to one file per process
    gpufeed_watch_stacks.py  samples the training thread's stack between batches: time in the model
                           step against CPU work outside it (augmentation, collate, copies)

Both are standard-library only and import nothing of gpufeed: the watched interpreter may not have
gpufeed installed, and the hook must cost next to nothing.
"""

from __future__ import annotations

import os

HOOK_DIR = os.path.dirname(os.path.abspath(__file__))
"""The folder to put first on the watched command's PYTHONPATH."""

ENV_DIR = "GPUFEED_WATCH_DIR"
"""The environment variable naming the folder the recorder writes its per-process files to."""
