-- ai-load-balancer: a pick's lease steps, second part (where a pick script says `--@commit`, after
-- pick_settle.lua and the policy's choice). Needs `pick`: the host to admit, or nil (no candidate,
-- or over maxRequestCount). The pick's record (for release.lua and, if the owner dies first,
-- reap.lua) and its +1; a tombstone already there means the plugin gave up on this pick before
-- Redis ran it (a stalled Redis runs it late): the pick then only deletes it, and the carried
-- releases still apply. Leaves `admitted`.
local admitted = false
if pick then
  if redis.call('HSETNX', mine, rec, pick) == 1 then
    admitted = true
    down[pick] = (down[pick] or 0) - 1
  else
    redis.call('HDEL', mine, rec)
  end
end
-- The counts that change, netted per pod (none when a release and the pick meet on one pod), in
-- one HSET of their new values: the script is atomic, so nothing changed them since the read, and a
-- pod absent from the hash was at 0. A stored count below 0 (a decrement that outlived a cleanup)
-- counts as 0. Only the changed pods are touched: a pick's Lua work does not grow with the cluster
-- beyond the one read.
local set = {}
for h, d in pairs(down) do
  if d ~= 0 then
    local c = tonumber(counts[h]) or 0
    if c < 0 then c = 0 end
    c = c - d
    if c < 0 then c = 0 end
    set[#set + 1] = h
    set[#set + 1] = c
  end
end
if #set > 0 then redis.call('HSET', inflight, unpack(set)) end
