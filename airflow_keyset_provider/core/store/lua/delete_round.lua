
-- Remove one round's keys and its index entries; never touches the watermark.
-- KEYS[1] open set  KEYS[2] chained id  KEYS[3] by_key hash  KEYS[4..] the round's keys
-- ARGV[1] round id  ARGV[2] idempotency key ('' = none)
-- Returns the number of keys removed.
-- Safe to run twice: the second run finds nothing left to remove and returns 0 (the count of
-- the run that removed the keys is lost with its reply; nothing else depends on it).
local n = 0
for i = 4, #KEYS do n = n + redis.call('DEL', KEYS[i]) end
redis.call('SREM', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.call('HDEL', KEYS[3], ARGV[2]) end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return n
