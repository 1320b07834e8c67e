
-- Hand out the next range id of a round that this counter never handed out (a hint for tasks
-- that pull ranges: the claim that follows is fenced per range as always). An id that a claim
-- coalesced ranges into ('skip:<id>', written by CLAIM) is jumped over with its run.
-- KEYS[1] round hash  ARGV[1] call id (unique per call, '' = none)
-- Returns {'lost'} (no round: nothing written) | {'closed'} (round not open)
--       | {'ok', id, n_ranges} (id >= n_ranges: every range was handed out once).
-- Safe to run twice: handing out an id writes 'next_call' = '<call id>|<id>' in the round hash,
-- so its second run hands out the same id again and moves the counter no further (no id is
-- skipped). A new call after one whose every retry failed is not that call: it hands out the
-- next id, and the one the lost call took waits, unclaimed, for a pulling task's rescue.
if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost'} end
if redis.call('HGET', KEYS[1], 'state') ~= 'open' then return {'closed'} end
local call = ARGV[1] or ''
if call ~= '' then
  local seen = redis.call('HGET', KEYS[1], 'next_call') or ''
  local head = call .. '|'
  if string.sub(seen, 1, #head) == head then
    return {'ok', tonumber(string.sub(seen, #head + 1)), redis.call('HGET', KEYS[1], 'n_ranges')}
  end
end
local i = tonumber(redis.call('HGET', KEYS[1], 'next') or '0')
for _ = 1, 256 do
  local after = redis.call('HGET', KEYS[1], 'skip:' .. i)
  if not after then break end
  i = tonumber(after)
end
redis.call('HSET', KEYS[1], 'next', i + 1)
if call ~= '' then redis.call('HSET', KEYS[1], 'next_call', call .. '|' .. i) end
return {'ok', i, redis.call('HGET', KEYS[1], 'n_ranges')}
