-- ai-load-balancer: reap(inflight, owners, now_ms), shared by the pick scripts and heartbeat.lua.
-- Owners (plugin VMs) whose lease ran out are gone (killed, out of memory, cut off): subtract
-- what each held from the in-flight hash and delete its hash. A few per call keep calls short.
-- An owner's hash is `<base>own:<owner>` where the owners key is `<base>owners`.
local function reap(inflight, owners, now_ms)
  local base = string.sub(owners, 1, #owners - 6)
  for _, dead in ipairs(redis.call('ZRANGEBYSCORE', owners, '-inf', now_ms, 'LIMIT', 0, 4)) do
    local own = base .. 'own:' .. dead
    local held = redis.call('HGETALL', own)
    for i = 1, #held, 2 do
      local c = tonumber(held[i + 1]) or 0
      if string.sub(held[i], 1, 2) == 'h:' and c > 0 then
        local h = string.sub(held[i], 3)
        if redis.call('HINCRBY', inflight, h, -c) < 0 then redis.call('HSET', inflight, h, 0) end
      end
    end
    redis.call('DEL', own)
    redis.call('ZREM', owners, dead)
  end
end
