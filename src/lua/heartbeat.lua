-- ai-load-balancer: renews one owner's lease (see lease.lua) and reaps owners whose lease ran out,
-- so that a dead gateway's counts return even when no request comes (after reap.lua).
-- KEYS[1]  in-flight hash   KEYS[2] owners sorted set   ARGV[1] lease (ms)   ARGV[2] owner id
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZADD', KEYS[2], now_ms + (tonumber(ARGV[1]) or 10000), ARGV[2])
reap(KEYS[1], KEYS[2], now_ms)
return 1
