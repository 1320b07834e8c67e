
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
