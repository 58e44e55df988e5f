-- ai-load-balancer: renews one owner's lease (see lease.lua) while it holds in-flight requests.
-- KEYS[1]  owners sorted set   ARGV[1] lease (ms)   ARGV[2] owner id
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZADD', KEYS[1], now_ms + (tonumber(ARGV[1]) or 10000), ARGV[2])
return 1
