-- ai-load-balancer: global least request pick, one round trip (after lease.lua).
-- ARGV[5]  N = number of healthy candidates
-- ARGV[6 .. 5+N]  healthy hosts, shuffled by the plugin (first minimum wins => random among ties)
-- Returns {host, in-flight after the pick, admitted 1|0}; admitted 0 means the +1 was undone (429).
local n = tonumber(ARGV[5]) or 0
if n < 1 then return {'', 0, 0} end
local counts = redis.call('HMGET', inflight, unpack(ARGV, 6, 5 + n))
local best, bestc = nil, nil
for i = 1, n do
  local c = tonumber(counts[i]) or 0
  if c < 0 then
    -- a decrement outlived a cleanup: repair instead of favouring this host forever
    redis.call('HSET', inflight, ARGV[5 + i], 0)
    c = 0
  end
  if bestc == nil or c < bestc then best, bestc = ARGV[5 + i], c end
end
if not admit(best) then return {'', 0, 0} end
local after = take(best)
if maxc > 0 and after > maxc then
  untake(best)
  unadmit()
  return {best, after, 0}
end
return {best, after, 1}
