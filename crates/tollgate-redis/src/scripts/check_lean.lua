-- The lean `CHECK` (see `lean.rs`): every request of the call has one check, of one GCRA
-- limit with no penalty, each on a key of its own; `K` holds the keys, one per request.
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
local interval, tolerance, burst = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, enforce = tonumber(ARGV[5]), ARGV[6] == '1'
local match, format, floor = string.match, string.format, math.floor
local out, o = {now}, 1
local n = #K
-- Reads every key first, then writes: a call that meets a key its node does not serve has
-- written nothing.
local tats = {}
for r = 1, n do
  local key = K[r]
  local status, figure = 0, 0
  -- A deny, then a block (`<base>:pb`, as in `check.lua`), refuses whatever the cost.
  local sc = redis.pcall('GET', string.sub(key, 1, -4) .. ':pb')
  if type(sc) == 'string' then
    local blocked, denied = match(sc, '^%d+:%d+:(%d+):%d+:%d+:(%d+)$')
    blocked, denied = tonumber(blocked) or 0, tonumber(denied) or 0
    if denied > now then
      status, figure = 4, denied - now
    elseif blocked > now then
      status, figure = 3, blocked - now
    end
  end
  local v = redis.call('GET', key)
  if status == 0 then
    local tat, from = false, 0
    if v then
      local t, i = match(v, '^(%d+):(%d+)$')
      if t then tat, from = tonumber(t), tonumber(i) end
    end
    -- Written under another quota (a plan, a reload): carry what the key used, as
    -- `tollgate_core::algorithm::gcra_carry` does.
    if tat and tat > now and from ~= interval and from ~= 0 then
      local d = tat - now
      local used = floor(d / from)
      if used * from > d then used = used - 1 elseif (used + 1) * from <= d then used = used + 1 end
      if used * from < d then used = used + 1 end
      local ahead = used * interval
      if ahead > 3155760000000000 then ahead = 3155760000000000 end
      tat = now + ahead
    end
    local base = now
    if tat and tat > now then base = tat end
    local new_tat = base + interval * cost
    if cost > burst then
      status = 2
    elseif new_tat - now > tolerance then
      status = 1
    else
      tats[r] = new_tat
    end
    figure = tat or 0
  end
  local committed = 1
  if status ~= 0 and (enforce or status == 4) then committed = 0 end
  out[o + 1], out[o + 2], out[o + 3] = committed, status, figure
  o = o + 3
end
for r = 1, n do
  local tat = tats[r]
  if tat then
    local ms = floor((tat - now + 999) / 1000)
    if ms < 1 then ms = 1 end
    redis.call('SET', K[r], format('%d:%d', tat, interval), 'PX', format('%d', ms))
  end
end
return struct.pack('<' .. string.rep('d', o), unpack(out, 1, o))
