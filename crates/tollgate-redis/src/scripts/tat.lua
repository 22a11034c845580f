
local floor = math.floor
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function fmt(x) return string.format('%d', x) end
local function ttl_ms(us)
  local ms = idiv(us + 999, 1000)
  if ms < 1 then ms = 1 end
  return fmt(ms)
end
-- The furthest ahead of now a sanction's end is taken to lie, in microseconds: 100 years,
-- tollgate_engine's `MAX_DENY`. An end stored further ahead (set before denies were bounded)
-- reads as this, so that every figure answered and every value written stays below 2^53,
-- whole and positive.
local MAX_AHEAD = 3155760000000000
-- A time `t` no further ahead of `now` than `MAX_AHEAD`.
local function within(t, now)
  if t > now + MAX_AHEAD then return now + MAX_AHEAD end
  return t
end
-- A GCRA key's value (`<base>:v2`): its TAT and the emission interval it was written under,
-- then, while the key has a block or a deny (at `<base>:pb`), when the later of them ends:
-- `<tat>:<interval>[:<until>]`. The lean check (`check_lean.lua`) reads a key's sanctions only
-- when `until` is ahead, so every script that writes the value keeps it while it is ahead,
-- and the key alive until then. Answers false for a key with no value.
local function read_tat(key)
  local v = redis.call('GET', key)
  if not v then return false, 0, 0 end
  local t, i, u = string.match(v, '^(%d+):(%d+):?(%d*)$')
  if not t then return false, 0, 0 end
  return tonumber(t), tonumber(i), tonumber(u) or 0
end
-- Writes a GCRA key's value at `now`: the key lives until its TAT and `hint` (its sanctions'
-- end, kept while ahead) are both past, and goes at once if they are.
local function write_tat(key, tat, interval, hint, now)
  if not tat or tat < now then tat = 0 end
  hint = within(hint, now)
  local last = tat
  local v = fmt(tat) .. ':' .. fmt(interval)
  if hint > now then
    v = v .. ':' .. fmt(hint)
    if hint > last then last = hint end
  end
  if last <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, v, 'PX', ttl_ms(last - now))
  end
end
