"""The cursor store's scripts for tasks that pull ranges: hand out the next unclaimed range, ask an
owner to split, the owner's split, the answer to a request (``store_scripts.py`` is the import
surface; ``store_pull.py`` calls them).
"""

from __future__ import annotations

from .lua import _INTACT, _NOW

NEXT_UNCLAIMED = """
-- Hand out the next range id of a round that this counter never handed out (a hint for tasks
-- that pull ranges: the claim that follows is fenced per range as always). An id that a claim
-- coalesced ranges into ('skip:<id>', written by CLAIM) is jumped over with its run.
-- KEYS[1] round hash.  Returns {'lost'} (no round: nothing written) | {'closed'} (round not open)
--       | {'ok', id, n_ranges} (id >= n_ranges: every range was handed out once).
if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost'} end
if redis.call('HGET', KEYS[1], 'state') ~= 'open' then return {'closed'} end
local i = tonumber(redis.call('HGET', KEYS[1], 'next') or '0')
for _ = 1, 256 do
  local after = redis.call('HGET', KEYS[1], 'skip:' .. i)
  if not after then break end
  i = tonumber(after)
end
redis.call('HSET', KEYS[1], 'next', i + 1)
return {'ok', i, redis.call('HGET', KEYS[1], 'n_ranges')}
"""

OPEN_BRIEFS = (
    """
-- The fields a pulling task reads of each range of one batch that is not complete (it never
-- claims, rescues or splits a complete one), so its polls at a round's end return what is left,
-- not every range. KEYS range hashes  ARGV[1] lineage ('' = any; else only the ranges whose
-- 'lineage' is this one: what a retry resumes)  ARGV[2] F  ARGV[3..F+2] field names
-- ARGV[F+3..] the range id of each key, in order
-- Returns {'lost', id} (a range has no state) | {'ok', now, id, values..., id, values..., ...}
-- (missing fields as '').
"""
    + _NOW
    + """
local f = tonumber(ARGV[2])
local names = {}
for j = 3, f + 2 do names[#names + 1] = ARGV[j] end
local out = {'ok', now}
for k = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[k], 'lo', 'hi', 'state', 'lineage', unpack(names))
  if not v[1] and not v[2] then return {'lost', ARGV[f + 2 + k]} end
  if v[3] ~= 'complete' and (ARGV[1] == '' or v[4] == ARGV[1]) then
    out[#out + 1] = ARGV[f + 2 + k]
    for j = 5, #v do out[#out + 1] = v[j] or '' end
  end
end
return out
"""
)

REQUEST_SPLIT = (
    """
-- An idle task asks the live owner of a running range to split it at its next chunk boundary.
-- KEYS[1] round hash  KEYS[2] range hash  ARGV[1] requester token  ARGV[2] ms after which an
-- unanswered request of another requester may be replaced
-- Returns 'lost' | 'closed' (round not open) | 'not_running' (complete, pending, released or
--   lease expired: claim it instead) | 'busy' (another request is pending) | 'asked'
"""
    + _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return 'lost' end
if redis.call('HGET', KEYS[1], 'state') ~= 'open' then return 'closed' end
local r = redis.call('HMGET', KEYS[2], 'state', 'owner', 'lease_until', 'split_req', 'split_req_ms')
if r[1] ~= 'running' or (r[2] or '') == '' or tonumber(r[3] or '0') <= now then
  return 'not_running'
end
if (r[4] or '') ~= '' and r[4] ~= ARGV[1] and now - tonumber(r[5] or '0') < tonumber(ARGV[2]) then
  return 'busy'
end
redis.call('HSET', KEYS[2], 'split_req', ARGV[1], 'split_req_ms', now)
-- this requester's answer to an earlier request goes: SPLIT_ANSWER must not return it again
local answer = redis.call('HGET', KEYS[2], 'split_answer') or ''
if string.sub(answer, 1, #ARGV[1] + 1) == ARGV[1] .. '|' then
  redis.call('HSET', KEYS[2], 'split_answer', '')
end
return 'asked'
"""
)

SPLIT = (
    """
-- The owner splits its range at a chunk boundary: (lo, hi] becomes (lo, at] and a new range
-- (at, hi], pending and unowned, is appended to the round; or it declines the pending request.
-- The owner passes an ``at`` above every key it has read (prefetch included); the script
-- refuses one that is not strictly between the committed cursor and hi, so no committed key,
-- retry or dead letter (all <= cursor) changes range, and the ranges still partition the round.
-- KEYS[1] round hash  KEYS[2] range hash  KEYS[3] retry hash  KEYS[4] dead list
-- KEYS[5] new range hash  KEYS[6] new retry hash  KEYS[7] new dead list  KEYS[8] events channel
-- ARGV[1] owner token  ARGV[2] at ('' = decline the request)  ARGV[3] new range id (= n_ranges
-- as the caller read it)  ARGV[4] this range's id  ARGV[5] '1' = the caller keeps a checkpoint
-- mirror: the range is marked 'unmirrored_split:<new id>' = '<at> <old hi>' until the mirror has
-- recorded the split (``mirrored_split``); until then each record of the range carries it
-- Returns {'lost'} | {'not_owner', owner} | {'expired'} | {'closed'} (round not open)
--       | {'declined'} | {'moved', n_ranges} (another split took that id: read n again)
--       | {'bad_key', cursor, hi} | {'taken'} (the new range's keys exist) | {'ok', new id}
"""
    + _NOW
    + _INTACT
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or not intact(KEYS[2], KEYS[3], KEYS[4]) then
  return {'lost'}
end
local r = redis.call('HMGET', KEYS[2], 'owner', 'lease_until', 'cursor', 'hi', 'split_req')
if r[1] ~= ARGV[1] then return {'not_owner', r[1] or ''} end
if tonumber(r[2]) <= now then return {'expired'} end
local rnd = redis.call('HMGET', KEYS[1], 'state', 'n_ranges')
if rnd[1] ~= 'open' then return {'closed'} end
local asked = r[5] or ''
local at = ARGV[2]
if at == '' then
  if asked ~= '' then redis.call('HSET', KEYS[2], 'split_req', '', 'split_answer', asked .. '|no') end
  return {'declined'}
end
if rnd[2] ~= ARGV[3] then return {'moved', rnd[2]} end
if not (at > r[3] and at < r[4]) then return {'bad_key', r[3], r[4]} end
if redis.call('EXISTS', KEYS[5], KEYS[6], KEYS[7]) > 0 then return {'taken'} end
redis.call('HSET', KEYS[5], 'lo', at, 'hi', r[4], 'cursor', at, 'state', 'pending',
  'dead', 0, 'retries', 0, 'split_from', ARGV[4], 'created_ms', now)
local answer = ''
if asked ~= '' then answer = asked .. '|' .. ARGV[3] end
redis.call('HSET', KEYS[2], 'hi', at, 'split_req', '', 'split_answer', answer)
if ARGV[5] == '1' then redis.call('HSET', KEYS[2], 'unmirrored_split:' .. ARGV[3], at .. ' ' .. r[4]) end
redis.call('HSET', KEYS[1], 'n_ranges', tonumber(ARGV[3]) + 1)
redis.call('HINCRBY', KEYS[1], 'splits', 1)
redis.call('PUBLISH', KEYS[8], ARGV[4] .. ':split:' .. ARGV[3])
return {'ok', ARGV[3]}
"""
)

SPLIT_ANSWER = (
    """
-- Read-only: the answer to a split request. KEYS[1] range hash  ARGV[1] requester token
-- Returns {'pending'} (asked, the owner is live and has not reached a chunk boundary yet)
--       | {'ok', new range id} | {'no'} (declined, or the request is moot: the range completed,
--         its owner released it or its lease ran out, or another request replaced this one)
"""
    + _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'state', 'owner', 'lease_until', 'split_req', 'split_answer')
local answer = r[5] or ''
local head = ARGV[1] .. '|'
if string.sub(answer, 1, #head) == head then
  local v = string.sub(answer, #head + 1)
  if v == 'no' then return {'no'} end
  return {'ok', v}
end
if r[4] == ARGV[1] and r[1] == 'running' and (r[2] or '') ~= '' and tonumber(r[3] or '0') > now then
  return {'pending'}
end
return {'no'}
"""
)

__all__ = ["NEXT_UNCLAIMED", "OPEN_BRIEFS", "REQUEST_SPLIT", "SPLIT", "SPLIT_ANSWER"]
