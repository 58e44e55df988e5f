-- ai-load-balancer: global least request pick, one round trip (after lease.lua).
-- ARGV[6]  N = number of healthy candidates
-- ARGV[7 .. 6+N]  healthy hosts, shuffled by the plugin (first minimum wins => random among ties)
-- ARGV[7+N ..]    other hosts still in the cluster (unhealthy/degraded: kept by the cleanup)
-- Returns {host, in-flight after the pick, admitted 1|0}; admitted 0 means the +1 was undone (429).
cleanup(7)
local n = tonumber(ARGV[6]) or 0
if n < 1 then return {'', 0, 0} end
local counts = redis.call('HMGET', inflight, unpack(ARGV, 7, 6 + n))
local best, bestc = nil, nil
for i = 1, n do
  local c = tonumber(counts[i]) or 0
  if c < 0 then
    -- a decrement outlived a cleanup: repair instead of favouring this host forever
    redis.call('HSET', inflight, ARGV[6 + i], 0)
    c = 0
  end
  if bestc == nil or c < bestc then best, bestc = ARGV[6 + i], c end
end
local after = take(best)
if maxc > 0 and after > maxc then
  untake(best)
  return {best, after, 0}
end
admit(best)
return {best, after, 1}
