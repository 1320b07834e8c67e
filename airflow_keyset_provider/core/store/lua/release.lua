
-- Give the range up so the next worker need not wait for the lease to expire. A complete range
-- is compacted (its owner's fields go); an unfinished one keeps its lineage (a later try of
-- the same lineage finds it) and its last heartbeat.
-- KEYS[1] range hash  ARGV[1] owner token.  Returns 1 if released, 0 if not the owner.
--!include fields.lua
--!include compact.lua

local r = redis.call('HMGET', KEYS[1], 'owner', 'state')
if r[1] ~= ARGV[1] then return 0 end
if r[2] == 'complete' then
  compact(KEYS[1])
  return 1
end
redis.call('HDEL', KEYS[1], 'owner', 'lease_until')
redis.call('HSET', KEYS[1], 'state', 'pending')
return 1
