-- The lean `CHECK` (see `lean.rs`): every request of the call has one check, of one GCRA
-- limit with no penalty, each on a key of its own; `K` holds the keys, one per request.
-- ARGV[1]: little-endian doubles: `now` (below 0: the server's `TIME`), the emission
-- interval, the tolerance, the burst, the cost of every request, 1 if they are enforced.
-- ARGV[2]: the TTL in milliseconds of a key that one request's cost takes from fresh.
local now, interval, tolerance, burst, cost, enforce = struct.unpack('<dddddd', ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
enforce = enforce == 1
local out, o = {now, 0, 0, 0}, 1
local n = #K
-- A key with no value (the commonest: a client new to the limit) costs one command when a
-- fresh key would admit its request: the write of its first TAT, made only if the key has
-- none (`NX`), which answers the value the key has otherwise (`GET`). The value is the same
-- for every key of the call: a run that begins now (`tat_value`, in the prepended `tat.lua`).
local fresh, fresh_ms = false, ARGV[2]
if cost <= burst and interval * cost <= tolerance then
  fresh = tat_value(now + interval * cost, interval, 0, now, now)
end
-- The TATs to write, of keys that had a value, when their sanctions end and their runs began.
local tats, hints, sinces = nil, nil, nil
for r = 1, n do
  local key = K[r]
  local status, figure = 0, 0
  local tat, from, hint, since = false, 0, 0, 0
  local wrote, v = false, nil
  if fresh then
    v = redis.pcall('SET', key, fresh, 'NX', 'GET', 'PX', fresh_ms)
    if type(v) == 'table' and string.find(v.err, 'syntax', 1, true) then
      -- Before Redis 7, `SET` takes `NX` or `GET`, not both: every key is read on its own.
      fresh = false
    else
      wrote = v == false
    end
  end
  if not fresh then v = redis.pcall('GET', key) end
  if type(v) == 'table' then
    -- A key this node does not serve (the cross-slot form: its slot moved, or is moving and
    -- the key is not here): its request is not run (status 5), and nothing of it written;
    -- the client sends it again by hash slot.
    if not string.find(v.err, 'non local key', 1, true) then return v end
    status = 5
  elseif v then
    -- The key's value (`wrote`: the key had none, and its request is admitted).
    tat, from, hint, since = parse_tat(v)
    -- A sanction's end at most `MAX_AHEAD` ahead (`within`), so that the value written back
    -- keeps it whole and positive.
    hint = within(hint, now)
  end
  if hint > now then
    hints = hints or {}
    hints[r] = hint
    local sc = redis.pcall('GET', string.sub(key, 1, -4) .. ':pb')
    if type(sc) == 'string' then
      local blocked, denied = string.match(sc, '^%d+:%d+:(%d+):%d+:%d+:(%d+)$')
      blocked, denied = tonumber(blocked) or 0, tonumber(denied) or 0
      if denied > now then
        status, figure = 4, denied - now
      elseif blocked > now then
        status, figure = 3, blocked - now
      end
      if figure > MAX_AHEAD then figure = MAX_AHEAD end
    end
  end
  if status == 0 and not wrote then
    -- Written under another quota (a plan, a reload): carry what the key used (`carry`).
    tat = carry(tat, from, interval, now)
    local base = now
    if tat and tat > now then base = tat end
    local new_tat = base + interval * cost
    if cost > burst then
      status = 2
    elseif new_tat - now > tolerance then
      status = 1
    else
      tats, sinces = tats or {}, sinces or {}
      tats[r], sinces[r] = new_tat, run_of(tat, since, now)
    end
    figure = tat or 0
  end
  local committed = 1
  if status ~= 0 and (enforce or status >= 4) then committed = 0 end
  out[o + 1], out[o + 2], out[o + 3] = committed, status, figure
  o = o + 3
end
for r = 1, tats and n or 0 do
  local tat = tats[r]
  if tat then
    -- A value that said when the key's sanctions end keeps saying it (`write_tat`).
    write_tat(K[r], tat, interval, hints and hints[r] or 0, sinces[r], now)
  end
end
if o == 4 then return struct.pack('<dddd', out[1], out[2], out[3], out[4]) end
return struct.pack('<' .. string.rep('d', o), unpack(out, 1, o))
