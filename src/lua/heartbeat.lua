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
    local keep = {}
    for i = 4, #ARGV do keep[ARGV[i]] = true end
    for _, h in ipairs(redis.call('HKEYS', inflight)) do
      if not keep[h] then redis.call('HDEL', inflight, h) end
    end
    redis.call('SET', last_clean, math.floor(now / 1000))
  end
end
return 1
