-- Bench only: a script of ours that makes the Redis calls the Go plugin's prefix_cache script makes,
-- with its key and argument layout (read from its source; no text of it is here).
-- KEYS: key TTL, the count hash, a random healthy host, then every healthy host.
-- ARGV: the blocks' SHA-1s (upper-case hex). Chain key i = key i-1 XOR sha i, computed here in Lua
-- one bit at a time as Go's script does. Per present key: EXISTS, GET, EXPIRE. On a miss: HEXISTS,
-- HGET, HGETALL (least loaded healthy host). Then HINCRBY, and SET + EXPIRE per new key.
local ttl, hash_key, default = KEYS[1], KEYS[2], KEYS[3]
local healthy = {}
for i = 4, #KEYS do healthy[KEYS[i]] = true end
local function xor_hex(a, b)
  local out = {}
  for i = 1, #a, 2 do
    local x, y, r = tonumber(a:sub(i, i + 1), 16), tonumber(b:sub(i, i + 1), 16), 0
    for bit = 0, 7 do
      local v = 2 ^ bit
      if ((x % (v * 2)) >= v) ~= ((y % (v * 2)) >= v) then r = r + v end
    end
    out[#out + 1] = string.format('%02X', r)
  end
  return table.concat(out)
end
local target, key, cur, i = '', '', '', 1
while i <= #ARGV do
  if cur == '' then cur = ARGV[i] else cur = xor_hex(cur, ARGV[i]) end
  if redis.call('EXISTS', cur) ~= 1 then break end
  local h = redis.call('GET', cur)
  if not healthy[h] then break end
  key, target = cur, h
  redis.call('EXPIRE', cur, ttl)
  i = i + 1
end
if target == '' then
  i = 1
  target = default
  if redis.call('HEXISTS', hash_key, target) == 1 then
    local best = tonumber(redis.call('HGET', hash_key, target))
    local all = redis.call('HGETALL', hash_key)
    for j = 1, #all, 2 do
      local c = tonumber(all[j + 1])
      if healthy[all[j]] and (c < best or (c == best and math.random() >= 0.5)) then
        target, best = all[j], c
      end
    end
  end
end
redis.call('HINCRBY', hash_key, target, 1)
while i <= #ARGV do
  if key == '' then key = ARGV[i] else key = xor_hex(key, ARGV[i]) end
  redis.call('SET', key, target)
  redis.call('EXPIRE', key, ttl)
  i = i + 1
end
return target
