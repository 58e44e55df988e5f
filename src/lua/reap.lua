-- ai-load-balancer: the reaper, run by the heartbeat only (after shared.lua): picks and releases
-- never reap, so they do not pay for defining it.
-- Owners (plugin VMs) whose lease ran out are gone (killed, out of memory, cut off): subtract what
-- their admitted picks (request id -> host in their hash, see is_record) hold from the in-flight
-- hash and delete their hash. A few per call keep calls short.
local function reap(now)
  for _, dead in ipairs(redis.call('ZRANGEBYSCORE', owners, '-inf', now, 'LIMIT', 0, 8)) do
    local own = base .. 'own:' .. dead
    local held = redis.call('HGETALL', own)
    local per_host = {}
    for i = 2, #held, 2 do
      local h = held[i]
      if is_record(h) then per_host[h] = (per_host[h] or 0) + 1 end
    end
    for h, c in pairs(per_host) do
      if redis.call('HINCRBY', inflight, h, -c) < 0 then redis.call('HSET', inflight, h, 0) end
    end
    redis.call('DEL', own)
    redis.call('ZREM', owners, dead)
  end
end
