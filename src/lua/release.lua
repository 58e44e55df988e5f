-- ai-load-balancer: release one request's +1, exactly once, whatever the order of events.
-- KEYS[1]  in-flight hash of this route+cluster
-- KEYS[2]  this request's pick record (value = the host that got the +1)
-- ARGV[1]  tombstone TTL (s). > 0 when the plugin gave up waiting for the pick (Redis timeout,
--          client gone): if the pick has not run yet (no record), leave an empty record so that the
--          pick, arriving late, does nothing.
-- Returns the released host, or ''.
local h = redis.call('GET', KEYS[2])
if h and h ~= '' then
  redis.call('HINCRBY', KEYS[1], h, -1)
  redis.call('DEL', KEYS[2])
  return h
end
local ttl = tonumber(ARGV[1]) or 0
if not h and ttl > 0 then
  redis.call('SET', KEYS[2], '', 'EX', ttl)
end
return ''
