
-- The source lost rows the round still had to read: the round can never close.
-- KEYS[1] round hash  ARGV[1] reason
-- Returns 'marked' | 'lost' (no round: nothing written) | 'closed' (a closed round was proven
-- complete before the loss: it stays closed).
-- Safe to run twice: the second run writes the same state and reason and returns 'marked'.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'lost' end
if state == 'closed' then return 'closed' end
redis.call('HSET', KEYS[1], 'state', 'unrecoverable', 'reason', ARGV[1])
return 'marked'
