
-- Extend the lease, only for the current owner and only while the lease is still valid.
-- KEYS[1] range hash  ARGV[1] owner token  ARGV[2] lease ms
-- Returns 1 (extended) or 0 (this token no longer owns the range: stop).
-- Safe to run twice: it sets the lease to now + lease ms for the same owner; the second run
-- only extends it from a later now, as the next heartbeat would. If the lease ran out between
-- the two runs (a lease shorter than redis-py's retry delay), the second writes nothing and
-- answers 0, which is true: the owner must stop (its next advance would be refused anyway).
--!include now.lua

local r = redis.call('HMGET', KEYS[1], 'owner', 'lease_until')
if r[1] ~= ARGV[1] or tonumber(r[2]) <= now then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[2]), 'heartbeat_ms', now)
return 1
