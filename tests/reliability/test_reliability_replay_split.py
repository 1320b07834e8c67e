"""Lost replies x dynamic splitting and coalescing: scenario 12's model-based trials
(``test_reliability_split.run_trial``, ``split_sim.Sim``) run on a client whose calls lose their
reply at random (``redis_faults.py``), with redis-py's retry on (10 retries, no backoff).

Every answer of the store is still checked against the model when it comes back: a claim that
coalesces reports what it absorbed, a split returns its new range, ``next_unclaimed`` never skips
or repeats an id, a split request's answer is not cleared by its own second run, a live owner is
never refused and a stale one always is; and at the end 0 keys lost, the ranges partition the
round, every key committed exactly once, at most one chunk again per crash, stall or zombie. A
second run of any of those calls that wrote again, or answered otherwise, fails the trial.

HEARTBEAT is spared: the simulation makes a lease run out with a last heartbeat of a 1 ms lease
(Redis' clock cannot be moved), and a second run of that call, a moment later, truly finds the
lease gone and answers 0 (the owner must stop), which the model does not expect of a live owner.
Its second run with a real lease (longer than redis-py's retry delay) extends the lease again
(``test_reliability_replay_store.py::test_heartbeat_and_close``).
"""

from __future__ import annotations

import hashlib
import random

import redis_faults as rf
import reliability_support as rs
from split_model import Figures
from test_reliability_split import run_trial

from airflow_keyset_provider.core.store.scripts import HEARTBEAT

SCENARIO = "split + crash + takeover (model) x lost replies"
KINDS = (rf.LOST_REPLY, rf.LOST_REPLY_TIMEOUT, rf.RESET, rf.TIMEOUT_BEFORE_SEND)
_HEARTBEAT_SHA = hashlib.sha1(HEARTBEAT.encode()).hexdigest()


def test_split_trials_under_random_lost_replies(redis_url: str, key_prefix: str) -> None:
    base = random.SystemRandom().randrange(10**9)
    total, faults = Figures(), 0
    for seed in range(base, base + rs.trials(30, 2000)):
        spare = frozenset({_HEARTBEAT_SHA})
        plan = rf.FaultPlan(chooser=rf.random_chooser(random.Random(seed), 0.15, KINDS, spare))
        client = rf.faulty_client(redis_url, plan, retries=10)
        try:
            total.add(run_trial(client, key_prefix, seed))
        except Exception as exc:
            raise AssertionError(f"seed {seed} (faults so far {plan.faulted[-3:]})") from exc
        finally:
            plan.enabled = False
            client.close()
        faults += plan.count()
    note = (
        f"seeds {base}..{base + total.trials - 1}: {faults} faults, {total.splits} splits, "
        f"{total.coalesced} ranges coalesced, {total.crashes} crashes, {total.takeovers} "
        f"takeovers, {total.stale_refused} stale calls refused, {total.replayed_keys} keys replayed"
    )
    rs.record(
        SCENARIO,
        trials=total.trials,
        keys_lost=total.keys_lost,
        max_replay=total.max_replay_chunks,
        note=note,
    )
    print(f"\n{SCENARIO}: {total.trials} trials; {note}")
    assert total.keys_lost == 0 and total.max_replay_chunks <= 1
    assert faults > total.trials and total.splits > 0 and total.coalesced > 0, note
