-- now: the Redis server's clock in milliseconds (leases are measured on it, never on a
-- worker's clock). Defines the local `now`.

local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)
