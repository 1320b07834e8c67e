"""The Redis side: the cursor store, the only code that reads or writes the engine's Redis keys.

Owns the key layout (one hash tag per stream, ``cursor_store``'s docstring), the compact range
hashes (``layout``), the reads (``reads``), the round-level writes (``rounds``), pull mode's writes
(``pull``), the named results of every script (``results``), the connection and eviction check
(``server``) and the Lua scripts (``lua/*.lua``, loaded by ``scripts``). May use the shared vocabulary (``core.keys``, ``core.errors``, ``core.states``);
knows nothing of SQL, processors or Airflow. ``from airflow_keyset_provider.core.store import
CursorStore`` keeps working: the public names are re-exported here.
"""

from .cursor_store import (
    Advanced,
    Claim,
    Closed,
    CursorStore,
    Gap,
    Unrecoverable,
    connect_redis,
)

__all__ = ["Advanced", "Claim", "Closed", "CursorStore", "Gap", "Unrecoverable", "connect_redis"]
