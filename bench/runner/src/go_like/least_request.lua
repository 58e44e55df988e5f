-- Bench only: a script of ours that makes the Redis calls the Go plugin's global_least_request
-- script makes, with its key and argument layout (read from its source; no text of it is here).
-- KEYS: seed, the count hash, a random healthy host, then every healthy host. ARGV: none.
-- HEXISTS the random host; if counted: HGET it, HGETALL the hash and take the least loaded healthy
-- host (a coin flip among ties); HINCRBY the winner. The release is a plain HINCRBY -1.
local hash_key, pick = KEYS[2], KEYS[3]
math.randomseed(tonumber(KEYS[1]) or 0)
local healthy = {}
for i = 4, #KEYS do healthy[KEYS[i]] = true end
if redis.call('HEXISTS', hash_key, pick) == 1 then
  local best = tonumber(redis.call('HGET', hash_key, pick))
  local all = redis.call('HGETALL', hash_key)
  for i = 1, #all, 2 do
    local c = tonumber(all[i + 1])
    if healthy[all[i]] and (c < best or (c == best and math.random() >= 0.5)) then
      pick, best = all[i], c
    end
  end
end
redis.call('HINCRBY', hash_key, pick, 1)
return pick
