"""Python runs this at start-up when `gpufeed watch` put its folder first on PYTHONPATH.

It starts the recorder when GPUFEED_WATCH_DIR is set, then runs the sitecustomize this file hides
(the next one on sys.path), so a site's own start-up code keeps working.
"""

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

try:
    import gpufeed_watch_hook  # type: ignore[import-not-found]  # the module beside this file

    gpufeed_watch_hook.start_from_env()
except Exception as _exc:  # the watched program must run even if the recorder cannot start
    sys.stderr.write(f"gpufeed watch: the recorder did not start in this process: {_exc}\n")


def _run_hidden_sitecustomize() -> None:
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_run_hidden_sitecustomize()
