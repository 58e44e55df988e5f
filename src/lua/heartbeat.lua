-- ai-load-balancer: every third of a lease, each plugin VM renews its lease for a route+cluster it
-- uses, reaps owners whose lease ran out (so a dead gateway's counts return even when no request
-- comes), and runs the periodic cleanup of hosts that left the cluster (after reap.lua).
-- KEYS[1]  in-flight hash
-- ARGV[1]  lease (ms)   ARGV[2] owner id   ARGV[3] cleanup interval (s, 0 = never)
-- ARGV[4 ..] every host still in the cluster (healthy or not), as this VM last saw it
local now = now_ms()
register(base .. 'own:' .. ARGV[2], ARGV[2], now + (tonumber(ARGV[1]) or 10000))
reap(now)
local interval = tonumber(ARGV[3]) or 0
if interval > 0 and #ARGV >= 4 then
  local last_clean = base .. 'last_clean'
  local last = tonumber(redis.call('GET', last_clean) or '0') or 0
  if now / 1000 - last >= interval then
    -- Only a count at 0 (or below) goes: this VM's view may be older than another gateway's (an
    -- idle group, or endpoints that reached that gateway first), and a new pod it has not seen may
    -- already have requests in flight. A pod that left with requests in flight reaches 0 as they
    -- end (or as their owner is reaped) and goes at a later cleanup. A missing field reads as 0,
    -- so deleting a 0 changes no pick.
    local keep = {}
    for i = 4, #ARGV do keep[ARGV[i]] = true end
    for h, c in pairs(all_counts()) do
      if not keep[h] and (tonumber(c) or 0) <= 0 then redis.call('HDEL', inflight, h) end
    end
    redis.call('SET', last_clean, math.floor(now / 1000))
  end
end
return 1
