-- ai-load-balancer: global least request pick, one round trip (after lease.lua).
-- ARGV[5 ..]  the healthy hosts, shuffled by the plugin (first minimum wins => random among ties).
--             Whole: rebuilding each host from a shared prefix and suffix cost more Redis time (a
--             new string per host) than its bytes saved.
-- Returns {host, in-flight after the pick, admitted 1|0}; admitted 0: over maxRequestCount, no +1
-- (429).
if #ARGV < 5 then
  commit(nil)
  return {'', 0, 0}
end
counts = all_counts()
settle()
local best, bestc = nil, nil
for i = 5, #ARGV do
  local h = ARGV[i]
  local c = read_count(h)
  if bestc == nil or c < bestc then best, bestc = h, c end
end
local after = bestc + 1
if maxc > 0 and after > maxc then
  commit(nil)
  return {best, after, 0}
end
if not commit(best) then return {'', 0, 0} end
return {best, after, 1}
