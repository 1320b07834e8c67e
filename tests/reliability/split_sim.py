"""Simulated workers driving the real ``CursorStore`` through random interleavings of the
scale-out protocol: pull a range (``next_unclaimed`` + ``claim``, the claim coalescing the fresh
ranges after it or not: ``split_coalesce``), read and commit chunks, ask a busy range to split
and claim the answer, split at a chunk boundary (the owner, above everything it has read,
prefetch included), release, crash, stall past the lease, come back stale.

One step is one store call (or one processor delivery), chosen by a seeded RNG, so a seed
replays the same interleaving. Every store answer is checked against the model the moment it
comes back (a live owner is never refused, a stale one always is and changes nothing, a claim
resumes at the committed cursor and coalesces what the model predicts); the end state is checked
by ``split_model``.

Redis measures leases on its own clock, which a test cannot move: a stall or a crash without a
restart makes the owner's last heartbeat a 1 ms lease and waits 3 ms, so "its lease ran out"
happens in milliseconds and deterministically.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from split_coalesce import (
    absorb,
    check_absorbed,
    check_held_by,
    check_hint,
    check_open_briefs,
    pick_coalesce,
    predict_absorbed,
)
from split_model import (
    EXPIRE_MS,
    LEASE_MS,
    Attempt,
    Figures,
    KeySpace,
    ModelRange,
    Record,
    check_outcome,
    check_partition,
    fail,
)

from airflow_keyset_provider.core.errors import KeysetError
from airflow_keyset_provider.core.store.cursor_store import Closed, CursorStore, Held

enc, dec = KeySpace.enc, KeySpace.dec


class Sim:
    """One trial: a round of random shape, a few workers, a chaos phase, a drive to completion."""

    def __init__(
        self, store: CursorStore, seed: int, split_policy: str = "owner", check_steps: bool = True
    ) -> None:
        self.store, self.seed, self.split_policy = store, seed, split_policy
        self.check_steps = check_steps  # off only to prove the end checks catch a bug alone
        rng = self.rng = random.Random(seed)
        n = rng.randint(20, 160)
        self.ks = KeySpace(rng.sample(range(1, 3 * n + 1), n))
        self.chunk_max = rng.randint(1, 8)
        self.p_crash = rng.choice([0.0, 0.02, 0.05])
        self.p_stall = rng.choice([0.0, 0.02, 0.05])
        self.chaos_steps = rng.randint(20, 250)
        self.attempts = [Attempt(f"w{i}", 1) for i in range(rng.randint(1, 4))]
        self.respawns: list[Attempt] = []
        self.model: dict[int, ModelRange] = {}
        self.rec = Record()
        self.fig = Figures(trials=1, keys=n)
        self.tokens = 0
        self.round_id = ""

    # ---- the trial ------------------------------------------------------------------------
    def run(self) -> Figures:
        self.plan()
        for _ in range(self.chaos_steps):
            self.step(chaos=True)
        self.drive()
        self.check()
        return self.fig

    def plan(self) -> None:
        end, k = self.ks.end, self.rng.randint(1, 12)
        cuts = sorted(self.rng.choices(range(1, end), k=min(k - 1, end - 1)))
        bounds = list(zip([0, *cuts], [*cuts, end], strict=True))
        self.round_id, created = self.store.create_round(
            idempotency_key=None,
            chained=False,
            start=enc(0),
            end=enc(end),
            source="{}",
            arity=1,
            bounds=[(enc(lo), enc(hi)) for lo, hi in bounds],
        )
        assert created
        self.model = {i: ModelRange(lo, hi, lo) for i, (lo, hi) in enumerate(bounds)}

    def drive(self) -> None:
        """No more chaos: every crashed lineage comes back, everything runs to completion, then
        every stalled or zombie attempt still around wakes up and must be refused."""
        limit = 200 * len(self.ks.keys) + 2000
        for _ in range(limit):
            if all(m.complete for m in self.model.values()) and not self.respawns:
                break
            self.step(chaos=False)
        else:
            fail(self.seed, f"no completion after {limit} steps: {self.model}")
        for a in self.attempts:
            if a.status in ("stalled", "zombie"):
                self.stale_act(a)

    def check(self) -> None:
        res = self.store.close_round(self.round_id)
        if not isinstance(res, Closed):
            fail(self.seed, f"close_round returned {res}, not Closed")
        briefs = self.store.range_briefs(self.round_id)
        self.fig.max_ranges = len(briefs)
        check_outcome(self.seed, self.ks, self.model, self.rec, self.fig)
        check_partition(self.seed, self.ks, briefs, self.model)
        if (res.done, res.skipped, res.dead) != (len(self.ks.keys), 0, 0):
            fail(self.seed, f"the round counted {res}, the table has {len(self.ks.keys)} keys")

    # ---- scheduling -----------------------------------------------------------------------
    def step(self, chaos: bool) -> None:
        live = [a for a in self.attempts if a.status == "live"]
        if chaos and live:
            r = self.rng.random()
            if r < self.p_crash:
                self.crash(self.rng.choice(live))
            elif r < self.p_crash + self.p_stall:
                owners = [a for a in live if a.rid is not None]
                if owners:
                    self.stall(self.rng.choice(owners))
        self.attempts = [a for a in self.attempts if a.status != "gone"]
        actors: list[Attempt | None] = [a for a in self.attempts if self.can_act(a)]
        actors += [None] * len(self.respawns)  # a crashed lineage's next attempt starts
        if not actors:
            return
        # owners act more often than idle attempts, which mostly poll and wait
        weights = [4.0 if a is not None and a.rid is not None else 1.0 for a in actors]
        a = self.rng.choices(actors, weights=weights)[0]
        if a is None:
            self.attempts.append(self.respawns.pop(self.rng.randrange(len(self.respawns))))
        else:
            self.act(a)

    def can_act(self, a: Attempt) -> bool:
        if a.status == "zombie":  # it acts once its range was taken over: then it is stale
            return a.rid is not None and self.model[a.rid].owner != a.token
        return a.status == "stalled" or (a.status == "live" and not a.finished)

    def act(self, a: Attempt) -> None:
        if a.status != "live":
            self.stale_act(a)
        elif a.rid is None:
            self.idle_act(a)
        else:
            self.owner_act(a)

    def choose(self, options: list[tuple[float, Callable[[Attempt], None]]], a: Attempt) -> None:
        weights = [w for w, _ in options]
        self.rng.choices([f for _, f in options], weights=weights)[0](a)

    # ---- an owner -------------------------------------------------------------------------
    def owner_act(self, a: Attempt) -> None:
        options: list[tuple[float, Callable[[Attempt], None]]] = [
            (5.0, self.commit if a.has_chunk else self.read),
            (0.3, lambda x: self.split(x, answering=False)),
        ]
        if a.request:
            options.append((3.0, lambda x: self.split(x, answering=True)))
        if not a.has_chunk:
            options.append((0.2, self.release))
        self.choose(options, a)

    def read(self, a: Attempt) -> None:
        """Hand the next chunk to the processor (it is processed from now on) and maybe read the
        one after it ahead (prefetch: read, not processed)."""
        if a.has_prefetch:
            a.chunk, a.chunk_end = a.prefetch, a.prefetch_end
        else:
            a.chunk, a.chunk_end = self.ks.chunk(
                a.cursor, a.hi, self.rng.randint(1, self.chunk_max)
            )
        a.has_chunk, a.prefetch, a.has_prefetch = True, [], False
        self.rec.delivered.update(a.chunk)
        if a.chunk_end < a.hi and self.rng.random() < 0.6:
            size = self.rng.randint(1, self.chunk_max)
            a.prefetch, a.prefetch_end = self.ks.chunk(a.chunk_end, a.hi, size)
            a.has_prefetch = True

    def advance(self, a: Attempt) -> Any:
        assert a.rid is not None
        return self.store.advance(
            self.round_id,
            a.rid,
            a.token,
            enc(a.cursor),
            enc(a.chunk_end),
            done=len(a.chunk),
            skipped=0,
            lease_ms=LEASE_MS,
            max_item_attempts=3,
        )

    def commit(self, a: Attempt) -> None:
        assert a.rid is not None
        m = self.model[a.rid]
        try:
            adv = self.advance(a)
        except KeysetError as exc:
            fail(self.seed, f"the live owner {a.token} of range {a.rid} was refused: {exc}")
        self.rec.committed.update(a.chunk)
        self.fig.chunks += 1
        m.cursor = a.cursor = a.chunk_end
        a.chunk, a.has_chunk = [], False
        if adv.cursor != enc(m.cursor) or adv.complete != m.complete:
            fail(self.seed, f"advance answered {adv}, the model has {m}")
        a.request = adv.split_req
        if adv.complete:
            self.finish_range(a)

    def finish_range(self, a: Attempt) -> None:
        assert a.rid is not None
        if a.request and self.rng.random() < 0.5:
            self.store.split(self.round_id, a.rid, a.token, None)
        self.release(a)

    def release(self, a: Attempt) -> None:
        assert a.rid is not None
        if not self.store.release(self.round_id, a.rid, a.token):
            fail(self.seed, f"the live owner {a.token} could not release range {a.rid}")
        self.model[a.rid].owner = ""
        self.fig.releases += 1
        a.rid, a.token, a.request = None, "", ""
        a.drop_reads()

    def split_candidates(self, a: Attempt) -> list[int]:
        """Real keys the owner may split at: strictly above all it has read (the ``naive``
        policy, a deliberate bug, only above the committed cursor) and strictly below hi."""
        floor = a.cursor if self.split_policy == "naive" else a.read_pos
        return [k for k in self.ks.between(floor, a.hi) if k < a.hi]

    def split(self, a: Attempt, answering: bool) -> None:
        assert a.rid is not None
        rid, old_hi = a.rid, a.hi
        cands = self.split_candidates(a)
        if not cands or (answering and self.rng.random() < 0.1):
            if answering:
                self.store.split(self.round_id, rid, a.token, None)
                self.fig.declined += 1
                a.request = ""
            return
        at = self.rng.choice(cands)
        new = self.store.split(self.round_id, rid, a.token, enc(at))
        if new is None:
            fail(self.seed, f"the live owner {a.token} could not split range {rid} at {at}")
        if new != len(self.model):
            fail(self.seed, f"split made range {new}, the round had {len(self.model)}")
        if self.check_steps:
            self.check_split(rid, new, at, old_hi)
        self.model[rid].hi = at
        self.model[new] = ModelRange(at, old_hi, at)
        a.hi, a.request = at, ""
        self.fig.splits += 1

    def check_split(self, rid: int, new: int, at: int, old_hi: int) -> None:
        parent = self.store.range(self.round_id, rid)
        child = self.store.range(self.round_id, new)
        got = (parent["hi"], child["lo"], child["hi"], child["cursor"], child["owner"])
        want = (enc(at), enc(at), enc(old_hi), enc(at), "")
        if got != want or child["state"] != "pending":
            fail(self.seed, f"split of {rid} at {at}: parent {parent}, child {child}")

    # ---- an idle attempt: pull a range, or ask a busy one to split -----------------------
    def idle_act(self, a: Attempt) -> None:
        if a.resume is not None:
            rid, a.resume = a.resume, None
            self.claim(a, rid)
            if a.rid != rid:
                fail(self.seed, f"the restarted {a.requester} could not resume range {rid}")
            return
        if a.asked is not None:
            answer = self.store.split_answer(self.round_id, a.asked, a.requester)
            if answer is not None:
                a.asked = None
                if answer != "no":
                    self.claim(a, int(answer))
            return
        if a.hint is not None:  # handed out at an earlier step: another claim may have
            rid, a.hint = a.hint, None  # coalesced it since (the claim then says complete)
            self.claim(a, rid)
            return
        rid = self.store.next_unclaimed(self.round_id)
        if self.check_steps:
            check_hint(self.seed, self.model, rid)
        if rid is not None:
            if self.rng.random() < 0.3:
                a.hint = rid
            else:
                self.claim(a, rid)
            return
        self.look_around(a)

    def look_around(self, a: Attempt) -> None:
        """Nothing unhanded left: claim a range nobody holds (released, lease run out, a split
        nobody claimed yet), else ask the busiest live one to split."""
        if self.rng.random() < 0.5:
            open_ = self.store.open_briefs(self.round_id, known_complete=a.known)
            if self.check_steps:
                check_open_briefs(self.seed, self.model, a, open_)
        else:
            briefs = self.store.range_briefs(self.round_id)
            open_ = [b for b in briefs if b.state != "complete"]
        if not open_:
            a.finished = True
            return
        free = [b for b in open_ if b.owner == "" or b.lease_ms_left <= 0]
        if free:
            self.claim(a, self.rng.choice(free).range_id)
            return
        left = {b.range_id: len(self.ks.between(dec(b.cursor), dec(b.hi))) for b in open_}
        busiest = max(open_, key=lambda b: (left[b.range_id], -b.range_id))
        if left[busiest.range_id] < 2:
            return
        outcome = self.store.request_split(self.round_id, busiest.range_id, a.requester)
        if outcome == "asked":
            a.asked = busiest.range_id
            self.fig.requests += 1
        elif outcome == "not_running":
            self.claim(a, busiest.range_id)

    def claim(self, a: Attempt, rid: int) -> None:
        """Claim ``rid``; the answer must be what the fence promises for the model's state."""
        m = self.model[rid]
        self.tokens += 1
        token = f"{a.requester}#{self.tokens}"
        held = m.owner != "" and not m.expired and m.lineage != a.lineage and not m.complete
        coalesce, pull = pick_coalesce(self.rng), self.rng.random() < 0.5
        res = self.store.claim(
            self.round_id, rid, token, a.lineage, LEASE_MS, coalesce=coalesce, pull=pull
        )
        if isinstance(res, Held) or res.complete:
            if isinstance(res, Held) != held or (not isinstance(res, Held) and not m.complete):
                fail(self.seed, f"claim of {rid} by {token} answered {res}, the model has {m}")
            return
        if held or m.complete or res.takeover != (m.owner != ""):
            fail(self.seed, f"claim of {rid} by {token} answered {res}, the model has {m}")
        self.fig.takeovers += int(res.takeover)
        ids = predict_absorbed(self.model, rid, coalesce)
        absorb(self.model, rid, ids)
        self.fig.coalesced += len(ids)
        m.owner, m.lineage, m.expired, m.claimed = token, a.lineage, False, True
        if self.check_steps:
            check_absorbed(self.seed, self.store, self.round_id, rid, ids, res, m.hi)
            if pull:
                check_held_by(self.seed, self.store, self.round_id, a, rid)
        # the worker goes by what the store says, as the engine does; the model checks it
        hi = dec(self.store.range(self.round_id, rid)["hi"])
        a.rid, a.token, a.cursor, a.hi, a.request = rid, token, dec(res.cursor), hi, ""
        a.drop_reads()
        if self.check_steps and (a.cursor, a.hi) != (m.cursor, m.hi):
            fail(self.seed, f"claim of {rid} resumes ({a.cursor}, {a.hi}], the model has {m}")

    # ---- chaos ----------------------------------------------------------------------------
    def run_out_lease(self, a: Attempt) -> None:
        """The owner's last heartbeat: a 1 ms lease (its real one would run out later; Redis'
        clock cannot be moved), then wait until it has run out."""
        assert a.rid is not None
        if not self.store.heartbeat(self.round_id, a.rid, a.token, EXPIRE_MS):
            fail(self.seed, f"the live owner {a.token} could not heartbeat range {a.rid}")
        time.sleep(0.003)
        self.model[a.rid].expired = True

    def crash(self, a: Attempt) -> None:
        """The worker's process dies. Either its task is retried (a new attempt of the lineage
        resumes the range at once; the old process may live on as a zombie), or nobody resumes
        it and its lease runs out (another task takes the range over)."""
        self.fig.crashes += 1
        nxt = Attempt(a.lineage, a.number + 1, resume=a.resume)  # a resume not done yet stays
        if a.rid is not None and self.rng.random() < 0.6:
            nxt.resume = a.rid
            if self.rng.random() < 0.4:
                a.status = "zombie"
            else:
                self.rec.abandon("crash", a)
                a.status = "gone"
        else:
            if a.rid is not None:
                self.run_out_lease(a)
            self.rec.abandon("crash", a)
            a.status = "gone"
        self.respawns.append(nxt)

    def stall(self, a: Attempt) -> None:
        """A pause past the lease (GC, SIGSTOP, partition): the attempt keeps what it believes."""
        self.fig.stalls += 1
        self.run_out_lease(a)
        a.status = "stalled"

    def stale_act(self, a: Attempt) -> None:
        """A stalled attempt wakes up, or a zombie acts after its range was taken over: its
        advance (of the chunk in hand, else of one more it reads) or its split must be refused
        and change nothing. Then it stops: a zombie for good, a stalled attempt goes idle."""
        assert a.rid is not None
        rid = a.rid
        before = self.snapshot(rid)
        cands = self.split_candidates(a)
        if cands and self.rng.random() < 0.4:
            at = self.rng.choice(cands)
            if self.store.split(self.round_id, rid, a.token, enc(at)) is not None:
                fail(self.seed, f"the stale {a.token} split range {rid} at {at}")
        else:
            if not a.has_chunk:
                self.read(a)
            try:
                self.advance(a)
            except KeysetError:
                pass
            else:
                fail(self.seed, f"the stale {a.token} advanced range {rid} to {a.chunk_end}")
        if self.snapshot(rid) != before:
            fail(self.seed, f"a refused call of the stale {a.token} changed range {rid}")
        self.fig.stale_refused += 1
        self.rec.abandon(a.status, a)
        a.status = "live" if a.status == "stalled" else "gone"
        a.rid, a.token, a.request = None, "", ""

    def snapshot(self, rid: int) -> tuple[Any, ...]:
        s = self.store
        pipe = s.client.pipeline(transaction=False)
        pipe.hgetall(s.range_key(self.round_id, rid))
        pipe.hgetall(s.round_key(self.round_id))
        pipe.exists(s.range_key(self.round_id, len(self.model)))
        return tuple(pipe.execute())
