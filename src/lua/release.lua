-- ai-load-balancer: release one request's +1, exactly once, whatever the order of events.
-- KEYS[1]  in-flight hash of this route+cluster
-- KEYS[2]  the picking owner's hash (see lease.lua)
-- ARGV[1]  request id
-- ARGV[2]  '1' when the plugin gave up waiting for the pick (Redis timeout, client gone): if the
--          pick has not run yet, leave a tombstone so that the pick, arriving late, does nothing.
-- Returns the released host, or ''. Once the owner's lease has run out its hash is gone and its
-- share was already subtracted: the release then does nothing.
local rec = 'r:' .. ARGV[1]
local h = redis.call('HGET', KEYS[2], rec)
if h and h ~= '' then
  redis.call('HDEL', KEYS[2], rec)
  if redis.call('HINCRBY', KEYS[1], h, -1) < 0 then redis.call('HSET', KEYS[1], h, 0) end
  if redis.call('HINCRBY', KEYS[2], 'h:' .. h, -1) <= 0 then redis.call('HDEL', KEYS[2], 'h:' .. h) end
  return h
end
if not h and ARGV[2] == '1' then
  redis.call('HSET', KEYS[2], rec, '')
end
return ''
