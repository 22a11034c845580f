-- An operator's change to one key's sanctions (see check.lua): `lift` (a reset: the block,
-- the refusals and the strikes go, a deny stays), `deny` for ARGV[2] microseconds, or
-- `undeny`. KEYS[1]: the key's `:pb`; KEYS[2], for a GCRA limit: its `:v3`, whose value
-- then says until when the sanctions last (see `read_tat`); after a reset's `reset.lua`,
-- ARGV[3] names the algorithm. Answers the server's time.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local key, op = KEYS[1], ARGV[1]
local sc = {0, 0, 0, 0, 0, 0}
local v = redis.call('GET', key)
if v then
  local n = 0
  for x in string.gmatch(v, '%d+') do
    n = n + 1
    sc[n] = tonumber(x)
  end
  for k = 2, 6 do
    if k ~= 4 then sc[k] = within(sc[k], now) end
  end
end
if op == 'lift' then
  sc = {0, 0, 0, 0, 0, sc[6]}
elseif op == 'deny' then
  -- The backend refuses a deny past `MAX_DENY`; bounded here too.
  sc[6] = within(now + tonumber(ARGV[2]), now)
elseif op == 'undeny' then
  sc[6] = 0
else
  return redis.error_reply('tollgate: unknown sanction ' .. tostring(op))
end
local last = math.max(sc[2], sc[3], sc[5], sc[6])
if last <= now then
  redis.call('DEL', key)
else
  redis.call('SET', key, fmt(sc[1]) .. ':' .. fmt(sc[2]) .. ':' .. fmt(sc[3]) .. ':' ..
    fmt(sc[4]) .. ':' .. fmt(sc[5]) .. ':' .. fmt(sc[6]), 'PX', ttl_ms(last - now))
end
if KEYS[2] and (ARGV[3] or 'gcra') == 'gcra' then
  local tat, interval, hint, since = read_tat(KEYS[2])
  local ends = math.max(sc[3], sc[6])
  if ends ~= hint and (tat or ends > now) then
    write_tat(KEYS[2], tat, interval, ends, since, now)
  end
end
return fmt(now)
