-- ai-load-balancer: global least request pick, one round trip (after prelude.lua; the lease steps
-- of pick_settle.lua and pick_commit.lua stand where `--@settle` and `--@commit` do).
-- KEYS[1]  in-flight hash of this route+cluster: host -> in-flight requests over the live owners
-- ARGV[1 .. 4]  max in-flight, lease, owner, this request's id and the carried releases
--               (pick_settle.lua)
-- ARGV[5 ..]  the healthy hosts, shuffled by the plugin (first minimum wins => random among ties).
--             Whole: rebuilding each host from a shared prefix and suffix cost more Redis time (a
--             new string per host) than its bytes saved.
-- Returns {host, in-flight after the pick, admitted 1|0}; admitted 0: over maxRequestCount, no +1
-- (429); {'', 0, 0}: no candidate, or a tombstone was there (the plugin gave up on this pick before
-- Redis ran it; the pick then only deletes it, the carried releases still apply).
--@settle
-- The least loaded candidate once the releases are applied (a count below 0 counts as 0).
local best, bestc = nil, nil
for i = 5, #ARGV do
  local h = ARGV[i]
  local c = (tonumber(counts[h]) or 0) - (down[h] or 0)
  if c < 0 then c = 0 end
  if bestc == nil or c < bestc then best, bestc = h, c end
end
local pick, reply = nil, {'', 0, 0}
if best then
  local maxc = tonumber(ARGV[1]) or 0
  if maxc > 0 and bestc >= maxc then
    reply = {best, bestc + 1, 0}
  else
    pick = best
  end
end
--@commit
if admitted then reply = {best, bestc + 1, 1} end
return reply
