"""Imported by the engine processes' forkserver only (``replica._PRELOAD``), never
anywhere else: it makes the forkserver, and so every engine process it forks, ignore
SIGTERM.

A service manager stopping the server signals every process of it at once (systemd's
default ``KillMode=control-group``, ``kill -TERM -PGID``). The API process then drains
its streams (``--grace-period``) and stops its engines itself, which must still be
running to finish those streams; and were the forkserver gone, the API process could no
longer read its engines' exit status (multiprocessing reports 255) and would take them
for dead. Neither outlives the API process: an engine sees EOF on its pipe and returns,
the forkserver exits when the last process that used it closes its end.
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
