-- ai-load-balancer: prefix-cache pick, one round trip (after lease.lua). Chain values are
-- computed by the plugin; their keys are `<base>pfx:<hex>`; a key's value is its holder, or with
-- `loadAware` up to `maxHolders` holders joined by ',', then '@' and the time it was written
-- (Redis's clock, s). A matched key is written again (new time, full TTL) only once an eighth of
-- its TTL has passed since it was written: a key lives at least 7/8 of `redisKeyTTL` after its
-- last use, and a hit does not pay one write per matched block (a value without a time, as an
-- older version wrote it, counts as written long ago).
-- ARGV[5]  key TTL (s)   ARGV[6] hit load factor (0 = off)
-- ARGV[7]  K = number of chain values (key_i = key_{i-1} XOR sha1(block_i)), value = host
-- ARGV[8 .. 7+K]  the chain values, upper-case hex, shortest prefix first
-- ARGV[8+K]  N = number of healthy candidates
-- ARGV[9+K .. 8+K+N]  healthy hosts, shuffled by the plugin (first minimum wins => random among ties)
-- Only with `loadAware` and fresh metrics for every healthy host (absent otherwise):
-- ARGV[9+K+N]  in-flight gap   ARGV[10+K+N] ratio   ARGV[11+K+N] max holders per key
-- ARGV[12+K+N]  one character per healthy host, '1' = overloaded by its queue or KV-cache use
-- ARGV[13+K+N .. 12+K+2N]  per healthy host, queue + weighted KV-cache use (added to in-flight)
-- ARGV[13+K+2N]  (`divertPrefixBytes` on) what a diverted hit gives up, in requests, by matched
--                length: `{length}:{cost}` where the cost rises, joined by ',' ('' = all 0)
-- Returns {host, in-flight after the pick, admitted 1|0, matched blocks, diverted 1|0, holder
-- added 1|0} (diverted: a prefix was found but its pod was too loaded, so the least loaded pod
-- was chosen instead; holder added: that pod now holds the matched prefix too).
local ttl = tonumber(ARGV[5]) or 1800
local factor = tonumber(ARGV[6]) or 0
local nk = tonumber(ARGV[7]) or 0
local chain = {}
for i = 1, nk do chain[i] = base .. 'pfx:' .. ARGV[7 + i] end
local first = 9 + nk
local n = tonumber(ARGV[8 + nk]) or 0
if n < 1 then
  commit(nil)
  return {'', 0, 0, 0, 0, 0}
end
local idx = {}
for i = 1, n do idx[ARGV[first - 1 + i]] = i end
local la = ARGV[first + n] ~= nil
local gap, ratio, maxh, flags = 0, 0, 1, ''
if la then
  gap = tonumber(ARGV[first + n]) or 0
  ratio = tonumber(ARGV[first + n + 1]) or 0
  maxh = tonumber(ARGV[first + n + 2]) or 1
  flags = ARGV[first + n + 3] or ''
end

-- A key's value split into its holders and the time it was written (0 when absent).
local function split(v)
  local at = string.find(v, '@', 1, true)
  if not at then return v, 0 end
  return string.sub(v, 1, at - 1), tonumber(string.sub(v, at + 1)) or 0
end

-- A key's healthy holders (`v`: its holders part), or nil.
local function live(v)
  if idx[v] then return {v} end
  if not string.find(v, ',', 1, true) then return nil end
  local hs = {}
  for h in string.gmatch(v, '[^,]+') do if idx[h] then hs[#hs + 1] = h end end
  if #hs == 0 then return nil end
  return hs
end

-- Longest present prefix of the chain, then the longest part of it with a healthy holder. Keys past
-- that point name gone/unhealthy hosts: they are re-homed below (same key, new host), so the chain
-- stays aligned.
local matched, held, vals, written = 0, nil, nil, {}
if nk > 0 then
  vals = redis.call('MGET', unpack(chain))
  for i = 1, nk do
    if vals[i] then vals[i], written[i] = split(vals[i]) end
  end
  local present = 0
  for i = 1, nk do
    if vals[i] then present = i else break end
  end
  for i = present, 1, -1 do
    local hs = live(vals[i])
    if hs then
      matched, held = i, {}
      for _, h in ipairs(hs) do held[h] = true end
      break
    end
  end
end

-- Each host's load: in flight, plus (loadAware) its queue and KV pressure. The least loaded host
-- (the miss path, and where a diverted hit goes), and the least loaded holder (the target).
counts = all_counts()
settle()
local least, leasts, lc, minc = nil, nil, 0, nil
local target, targets, targetc, ti = nil, nil, 0, 0
for i = 1, n do
  local h = ARGV[first - 1 + i]
  local c = read_count(h)
  local s = c
  if la then s = c + (tonumber(ARGV[first + n + 3 + i]) or 0) end
  if leasts == nil or s < leasts then least, leasts, lc = h, s, c end
  if minc == nil or c < minc then minc = c end
  if held and held[h] and (targets == nil or s < targets) then
    target, targets, targetc, ti = h, s, c, i
  end
end

local chosen = least
if target ~= nil then
  chosen = target
  -- Load guard (ours): a hot prefix must not pile every request onto one pod.
  if factor > 0 and targetc > factor * (minc + 1) then chosen = least end
  -- loadAware: overloaded by its metrics, or by in-flight past both the gap and the ratio over the
  -- pod a diverted request would go to (the least loaded by the combined signal). Not over the pod
  -- with the fewest in flight: a pod that has few only because its queue, KV use or slowness keeps
  -- requests away would make every hit elsewhere look overloaded and send it to a third pod.
  -- With `divertPrefixBytes`, only when the pod it would go to, charged with prefilling the
  -- matched prefix again, is still less loaded than the holder: a long cached document is not
  -- thrown away for a small gap.
  if la and (string.byte(flags, ti) == 49 or (targetc - lc > gap and targetc > ratio * lc)) then
    local costs = ARGV[first + 2 * n + 4]
    local cost = 0
    if costs ~= nil and costs ~= '' then
      for len, c in string.gmatch(costs, '(%d+):(%d+)') do
        if tonumber(len) > matched then break end
        cost = tonumber(c) or 0
      end
    end
    if costs == nil or leasts + cost < targets then chosen = least end
  end
end
local function diverted() if target ~= nil and chosen ~= target then return 1 end return 0 end

local after = read_count(chosen) + 1
if maxc > 0 and after > maxc then
  -- over maxRequestCount: the least loaded host instead, or a 429 (no +1)
  if chosen ~= least then
    chosen = least
    after = lc + 1
  end
  if after > maxc then
    commit(nil)
    return {chosen, after, 0, matched, diverted(), 0}
  end
end
if not commit(chosen) then return {'', 0, 0, 0, 0, 0} end

-- Matched keys still name a healthy host that holds that prefix: refresh them. The rest of the
-- chain (new blocks, and keys that named a gone/unhealthy host) now belongs to the chosen host.
-- loadAware, a diverted hit: the chosen host becomes one more holder of the matched keys, while a
-- key has fewer than `maxHolders` (holders are only added, never swapped for others while the key
-- lives, so a key cannot flip between pods; a full key keeps its holders until it expires).
local added = 0
local grow = la and diverted() == 1
local now = nk > 0 and math.floor(now_ms() / 1000) or 0
local stamp = '@' .. now
local fresh = ttl / 8
for i = 1, nk do
  local k = chain[i]
  if i <= matched then
    local hs = grow and live(vals[i]) or nil
    local has = false
    for _, h in ipairs(hs or {}) do if h == chosen then has = true end end
    if grow and hs == nil then
      redis.call('SET', k, chosen .. stamp, 'EX', ttl)
    elseif grow and not has and #hs < maxh then
      hs[#hs + 1] = chosen
      redis.call('SET', k, table.concat(hs, ',') .. stamp, 'EX', ttl)
      if i == matched then added = 1 end
    elseif now - written[i] >= fresh then
      redis.call('SET', k, vals[i] .. stamp, 'EX', ttl)
    end
  else
    redis.call('SET', k, chosen .. stamp, 'EX', ttl)
  end
end
return {chosen, after, 1, matched, diverted(), added}
