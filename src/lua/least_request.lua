-- ai-load-balancer: global least request pick, one round trip (after lease.lua).
-- ARGV[5]  P, ARGV[6] S: what every healthy host starts and ends with
-- ARGV[7 ..]  the rest of each healthy host (host = P .. ARGV[i] .. S), shuffled by the plugin (first
--             minimum wins => random among ties)
-- Returns {host, in-flight after the pick, admitted 1|0}; admitted 0: over maxRequestCount, no +1
-- (429).
local p, s = ARGV[5], ARGV[6]
local n = #ARGV - 6
if n < 1 then
  commit(nil)
  return {'', 0, 0}
end
local hosts = {}
for i = 1, n do hosts[i] = p .. ARGV[6 + i] .. s end
local counts = all_counts()
settle()
local best, bestc = nil, nil
for i = 1, n do
  -- (a count below 0, a decrement that outlived a cleanup, counts as 0 and commit repairs it)
  local c = read_count(hosts[i], counts[hosts[i]])
  if bestc == nil or c < bestc then best, bestc = hosts[i], c end
end
local after = bestc + 1
if maxc > 0 and after > maxc then
  commit(nil)
  return {best, after, 0}
end
if not commit(best) then return {'', 0, 0} end
return {best, after, 1}
