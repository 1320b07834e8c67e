
-- Give the range up so the next worker need not wait for the lease to expire. A complete range
-- is compacted (its owner's fields go); an unfinished one keeps its lineage (a later try of
-- the same lineage finds it) and its last heartbeat.
-- KEYS[1] range hash  KEYS[2] the stream's released list  ARGV[1] owner token
-- ARGV[2] call id (unique per call, '' = none)
-- Returns 1 if released, 0 if not the owner.
-- Safe to run twice: a release writes 'call' = the call id in the range hash (a complete range
-- is compacted, which drops the field: its call id goes to the released list instead,
-- includes/released.lua), so its second run writes nothing and returns 1 again, not 0 ("not
-- the owner"): the owner's fields are already gone.
--!include fields.lua
--!include compact.lua
--!include released.lua

local call = ARGV[2] or ''
local r = redis.call('HMGET', KEYS[1], 'owner', 'state', 'call')
local ownerless = (r[1] or '') == ''
if call ~= '' and (r[3] == call
    or (r[2] == 'complete' and ownerless and released_call(KEYS[2], call))) then
  return 1
end
if r[1] ~= ARGV[1] then return 0 end
if r[2] == 'complete' then
  compact(KEYS[1])
  if call ~= '' then remember_released(KEYS[2], call) end
else
  redis.call('HDEL', KEYS[1], 'owner', 'lease_until')
  redis.call('HSET', KEYS[1], 'state', 'pending')
  if call ~= '' then redis.call('HSET', KEYS[1], 'call', call) end
end
return 1
