-- released_call(list, call): true when the call id is one of the last RELEASED_CAP steps of the
-- stream that released a complete range (ADVANCE with release, RELEASE of a complete range),
-- which remember_released(list, call) records. Such a step compacts the range, which drops its
-- 'call' field (a field per complete range would cost 16 bytes each: over issue #11's budget),
-- so a second run of it is recognised here. The list is capped: it grows with nothing, and a
-- second run comes right after the first (redis-py's retry), while far fewer ranges are released.

local RELEASED_CAP = 1024
local function released_call(list, call)
  for _, v in ipairs(redis.call('LRANGE', list, 0, RELEASED_CAP - 1)) do
    if v == call then return true end
  end
  return false
end
local function remember_released(list, call)
  redis.call('LPUSH', list, call)
  redis.call('LTRIM', list, 0, RELEASED_CAP - 1)
end
