-- ai-load-balancer: release one request's +1, exactly once, whatever the order of events (after
-- reap.lua, for the key names).
-- KEYS[1]  in-flight hash of this route+cluster
-- ARGV[1]  the picking owner's id   ARGV[2] request id
-- ARGV[3]  the host an admitted request went to: the end of that request.
--          Absent: the plugin gave up waiting for the pick (Redis timeout, client gone): undo it if
--          it ran; if it has not run yet, leave a tombstone so that the pick, arriving late, does
--          nothing.
-- Returns 1 when a count went down, else 0. Once the owner's lease has run out its picks were
-- already subtracted and its hash deleted: the release then does nothing.
local mine = base .. 'own:' .. ARGV[1]
local rec = ARGV[2]
local h = ARGV[3]
if not h then
  h = redis.call('HGET', mine, rec)
  if not h then
    redis.call('HSET', mine, rec, '')
    return 0
  end
  if h == '' then return 0 end
end
if redis.call('HDEL', mine, rec) == 0 then return 0 end
if redis.call('HINCRBY', inflight, h, -1) < 0 then redis.call('HSET', inflight, h, 0) end
return 1
