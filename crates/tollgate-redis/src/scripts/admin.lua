
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function fmt(x) return string.format('%d', x) end
local op, alg, period, key = ARGV[1], ARGV[2], tonumber(ARGV[3]), KEYS[1]
-- A peek also answers the key's sanctions (its last declared key, `<base>:pb`): a block or a
-- deny refuses the next request whatever the state says.
local sc = false
if op == 'peek' and ARGV[5] == 'pb' then sc = redis.call('GET', KEYS[#KEYS]) end
if alg == 'window' then
  local i = math.floor(now / period)
  if i * period > now then i = i - 1 elseif (i + 1) * period <= now then i = i + 1 end
  local k = i - tonumber(ARGV[4]) + 1
  if k < 1 or k > 3 then
    return redis.error_reply('TOLLGATE_WINDOW ' .. fmt(now))
  end
  return {fmt(now), redis.call('GET', KEYS[k]), sc}
end
if alg == 'log' then
  return {fmt(now), redis.call('ZRANGEBYSCORE', key, '(' .. fmt(now - period), '+inf', 'WITHSCORES'), sc}
end
if alg == 'slots' then
  return {fmt(now), redis.call('ZCOUNT', key, '(' .. fmt(now), '+inf'), sc}
end
return {fmt(now), redis.call('GET', key), sc}
