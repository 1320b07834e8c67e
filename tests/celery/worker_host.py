"""``[core] hostname_callable`` of the test's Celery workers: ``KEYSET_CELERY_WORKER_HOST``.

Both workers run on one machine, so the default (the FQDN) would give every task instance the same
``hostname``; each worker is started with its own value, as two machines would have their own.
"""

from __future__ import annotations

import os
import socket


def hostname() -> str:
    return os.environ.get("KEYSET_CELERY_WORKER_HOST") or socket.getfqdn()
