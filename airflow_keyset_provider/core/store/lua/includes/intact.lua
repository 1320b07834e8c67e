-- intact(range, retry, dead): a range is intact when its hash exists and the counts it keeps
-- beside what they count agree: `retries` = HLEN of its retry hash, `dead` = LLEN of its dead
-- list (every script that changes one changes the other in the same step). A piece evicted or
-- deleted on its own (one retry hash, one dead list) breaks the equality and reads as lost, never
-- as "nothing left". A range written before the counts were kept (no `retries` field) is checked
-- for existence only.

local function intact(range, retry, dead)
  if redis.call('EXISTS', range) == 0 then return false end
  local c = redis.call('HMGET', range, 'retries', 'dead')
  if not c[1] then return true end
  return tonumber(c[1]) == redis.call('HLEN', retry) and tonumber(c[2]) == redis.call('LLEN', dead)
end
