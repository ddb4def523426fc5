"""Child processes that never outlive their parent.

    die_with_parent(parent)   # in the child, as it starts: `sig` to it once `parent` is gone

Linux sends the signal the moment the parent dies (PR_SET_PDEATHSIG); elsewhere a daemon thread
watches the parent pid. A parent that died before the call is caught by comparing the pid."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

WATCH_S = 0.5


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have `sig` sent to this process when its parent (pid `parent`, the process that started it) dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    else:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(WATCH_S)
            os.kill(os.getpid(), sig)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os.kill(os.getpid(), sig)
