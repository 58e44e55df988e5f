-- ai-load-balancer: prefix-cache pick, one round trip (after prelude.lua; the lease steps of
-- pick_settle.lua and pick_commit.lua stand where `--@settle` and `--@commit` do). Chain values are
-- computed by the plugin; their keys are `<base>pfx:<hex>`; a key's value is its holder, or with
-- `loadAware` up to `maxHolders` holders joined by ',', then '@' and the time it was written
-- (unix s, the writing gateway's clock). A matched key is written again (new time, full TTL) only
-- once an eighth of its TTL has passed since it was written: a key lives at least 7/8 of
-- `redisKeyTTL` after its last use, and a hit does not pay one write per matched block (a value
-- without a time, as an older version wrote it, counts as written long ago). The time comes from
-- the gateway, not Redis's TIME, which cost a pick about 4 us (bench/HISTORY.md, "Flat prefix-cache
-- picks"); clocks skewed by less than an eighth of the TTL (225 s by default) only move a refresh,
-- and past that a key in use can expire early: one miss, whose pick writes it again.
-- KEYS[1]  in-flight hash of this route+cluster: host -> in-flight requests over the live owners
-- ARGV[1 .. 4]  max in-flight, lease, owner, this request's id and the carried releases
--               (pick_settle.lua)
-- ARGV[5]  key TTL (s)   ARGV[6] now (unix s)   ARGV[7] hit load factor (0 = off), or 'pin': the
--          first chain value is a stored response's (a request that continues it) and the gateway
--          does not know its pod: a miss never writes that key (the pod it chooses would answer 404,
--          and the key would send every later request for the response there); only the reply's
--          record does
-- ARGV[8]  K = number of chain values (key_i = key_{i-1} XOR sha1(block_i)), value = host
-- ARGV[9 .. 8+K]  the chain values, upper-case hex, shortest prefix first
-- ARGV[9+K]  N = number of healthy candidates
-- ARGV[10+K .. 9+K+N]  healthy hosts, shuffled by the plugin (first minimum wins => random among
--                      ties)
-- Only with `loadAware` and fresh metrics for every healthy host (absent otherwise):
-- ARGV[10+K+N]  in-flight gap   ARGV[11+K+N] ratio   ARGV[12+K+N] max holders per key
-- ARGV[13+K+N]  one character per healthy host, '1' = overloaded by its queue or KV-cache use
-- ARGV[14+K+N .. 13+K+2N]  per healthy host, queue + weighted KV-cache use (added to in-flight)
-- ARGV[14+K+2N]  (`divertPrefixBytes` on) what a diverted hit gives up, in requests, by matched
--                length: `{length}:{cost}` where the cost rises, joined by ',' ('' = all 0)
-- Returns {host, in-flight after the pick, admitted 1|0, matched blocks, diverted 1|0, holder
-- added 1|0} (diverted: a prefix was found but its pod was too loaded, so the least loaded pod
-- was chosen instead; holder added: that pod now holds the matched prefix too); {'', 0, 0, 0, 0, 0}:
-- no candidate, or a tombstone was there (see pick_commit.lua).
local maxc = tonumber(ARGV[1]) or 0
local ttl = tonumber(ARGV[5]) or 1800
local now = tonumber(ARGV[6]) or 0
local factor = tonumber(ARGV[7]) or 0
local pinned = ARGV[7] == 'pin'
local nk = tonumber(ARGV[8]) or 0
local first = 10 + nk
local n = tonumber(ARGV[9 + nk]) or 0
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

-- A key's healthy holders (`v`: its holders part), or nil. The one function the script defines:
-- the match (the probe and the whole chain) and a diverted hit's new holder all need it.
local function live(v)
  if idx[v] then return {v} end
  if not string.find(v, ',', 1, true) then return nil end
  local hs = {}
  for h in string.gmatch(v, '[^,]+') do if idx[h] then hs[#hs + 1] = h end end
  if #hs == 0 then return nil end
  return hs
end

-- The match. A request's chain is usually the previous request's plus one block (a chat's next
-- turn, an agent's next tool round), so its second-to-last key is there, naming a healthy holder,
-- written within the last eighth of the TTL: the probe reads the last two keys only, and the
-- longest of them that qualifies is the match. A pick's Redis time then stays flat as a
-- conversation grows, where reading every key cost about 4 us per block (bench `redis-cost
-- --blocks 30`). A key's presence is evidence by itself (its value hashes every block before it),
-- so the probe's match needs no key before it. Otherwise (a new conversation, a holder gone, a key
-- due for its refresh) the rest of the chain is read too: the longest present prefix of the chain,
-- then the longest part of it with a healthy holder. Keys past that point name gone/unhealthy
-- hosts: they are re-homed below (same key, new host), so the chain stays aligned. Keys
-- `first_read`..`nk` were read: each value split into its holders (`vals`) and the time it was
-- written (`written`, 0 when absent).
local fresh = ttl / 8
local chain, matched, holders, vals, written = {}, 0, nil, {}, {}
local first_read = nk + 1
if nk > 0 and n > 0 then
  local lo, hi = nk > 1 and nk - 1 or 1, nk
  while lo <= hi do
    local names = {}
    for i = lo, hi do
      chain[i] = base .. 'pfx:' .. ARGV[8 + i]
      names[#names + 1] = chain[i]
    end
    local got = redis.call('MGET', unpack(names))
    for i = lo, hi do
      local v = got[i - lo + 1]
      if v then
        local at = string.find(v, '@', 1, true)
        if at then
          vals[i], written[i] = string.sub(v, 1, at - 1), tonumber(string.sub(v, at + 1)) or 0
        else
          vals[i], written[i] = v, 0
        end
      end
    end
    first_read = lo
    if lo == 1 then
      -- The whole chain is read.
      local present = 0
      for i = 1, nk do
        if not vals[i] then break end
        present = i
      end
      for i = present, 1, -1 do
        local hs = live(vals[i])
        if hs then
          matched, holders = i, hs
          break
        end
      end
      break
    end
    -- The probe: the longest of its keys with a healthy holder, if that key is fresh.
    for i = hi, lo, -1 do
      local hs = vals[i] and live(vals[i])
      if hs then
        if now - written[i] < fresh then
          matched, holders = i, hs
        end
        break
      end
    end
    if matched > 0 then break end
    lo, hi = 1, lo - 1
  end
end
-- The match's healthy holders, as a set.
local held = nil
if holders then
  held = {}
  for _, h in ipairs(holders) do held[h] = true end
end
--@settle
-- Each host's load: in flight (once the carried releases are applied; a count below 0 counts as
-- 0), plus (loadAware) its queue and KV pressure. The least loaded host (the miss path, and where a
-- diverted hit goes), and the least loaded holder (the target).
local least, leasts, lc, minc = nil, nil, 0, nil
local target, targets, targetc, ti = nil, nil, 0, 0
for i = 1, n do
  local h = ARGV[first - 1 + i]
  local c = (tonumber(counts[h]) or 0) - (down[h] or 0)
  if c < 0 then c = 0 end
  local s = c
  if la then s = c + (tonumber(ARGV[first + n + 3 + i]) or 0) end
  if leasts == nil or s < leasts then least, leasts, lc = h, s, c end
  if minc == nil or c < minc then minc = c end
  if held and held[h] and (targets == nil or s < targets) then
    target, targets, targetc, ti = h, s, c, i
  end
end

local chosen, chosenc = least, lc
if target ~= nil then
  chosen, chosenc = target, targetc
  -- Load guard (ours): a hot prefix must not pile every request onto one pod.
  if factor > 0 and targetc > factor * (minc + 1) then chosen, chosenc = least, lc end
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
    if costs == nil or leasts + cost < targets then chosen, chosenc = least, lc end
  end
end
-- Over maxRequestCount: the least loaded host instead, or a 429 (no +1).
local after, over = chosenc + 1, false
if chosen and maxc > 0 and after > maxc then
  chosen, after = least, lc + 1
  over = after > maxc
end
local diverted = 0
if target ~= nil and chosen ~= target then diverted = 1 end
local pick, reply = nil, {'', 0, 0, 0, 0, 0}
if over then
  reply = {chosen, after, 0, matched, diverted, 0}
elseif chosen then
  pick = chosen
end
--@commit
if admitted then
  -- Matched keys read above still name a healthy host that holds that prefix: refresh them. The
  -- rest of the chain (new blocks, and keys that named a gone/unhealthy host) now belongs to the
  -- chosen host. loadAware, a diverted hit: the chosen host becomes one more holder of the matched
  -- keys read, while a key has fewer than `maxHolders` (holders are only added, never swapped for
  -- others while the key lives, so a key cannot flip between pods; a full key keeps its holders
  -- until it expires). Keys before a probe's match are left alone: the requests that matched them
  -- last refreshed them, and once every conversation has moved past them they expire.
  local added = 0
  local grow = la and diverted == 1
  local stamp = '@' .. now
  for i = first_read, nk do
    if i > matched or not vals[i] then
      -- New, re-homed, or missing before the probe's match: the chosen host's now.
      if i > 1 or not pinned then redis.call('SET', chain[i], chosen .. stamp, 'EX', ttl) end
    else
      -- The key's holders once a diverted hit adds the chosen host (nil: unchanged).
      local grown = nil
      if grow then
        local hs = live(vals[i])
        local has = false
        for _, h in ipairs(hs or {}) do if h == chosen then has = true end end
        if hs == nil then
          grown = chosen
        elseif not has and #hs < maxh then
          hs[#hs + 1] = chosen
          grown = table.concat(hs, ',')
          if i == matched then added = 1 end
        end
      end
      if grown then
        redis.call('SET', chain[i], grown .. stamp, 'EX', ttl)
      elseif now - written[i] >= fresh then
        redis.call('SET', chain[i], vals[i] .. stamp, 'EX', ttl)
      end
    end
  end
  reply = {chosen, after, 1, matched, diverted, added}
end
return reply
