"""TaskFlow for keyset traversals: ``@task.keyset_traverse`` (registered in the provider info)."""

from .keyset import KeysetTraverseTask, keyset_round, keyset_traverse_task

__all__ = ["KeysetTraverseTask", "keyset_round", "keyset_traverse_task"]
