
for i = 1, #KEYS do
  local a = 2 + (i - 1) * 4
  local algo = tonumber(ARGV[a])
  local x, y, z = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local key = KEYS[i]
  if algo == 1 then
    local tat, interval, hint, since = read_tat(key)
    -- y: the TAT the check left, which a leased key's refund requires (0: any).
    -- z: the check's cost, given back in units of the interval the TAT is stored under now
    -- (a check of another plan may have carried it since); x: cost * the check's interval.
    if tat and (y == 0 or tat == y) then
      local back = x
      if z > 0 and interval > 0 then back = z * interval end
      write_tat(key, tat - back, interval, hint, since, now)
    end
  elseif algo == 2 then
    local wkey = key
    local count = tonumber(redis.call('GET', wkey) or '')
    if count ~= nil then
      if count <= y then redis.call('DEL', wkey) else redis.call('DECRBY', wkey, y) end
    end
  elseif algo == 4 then
    redis.call('ZREM', key, fmt(x) .. '-' .. fmt(y) .. '-' .. fmt(z))
  elseif algo == 3 then
    log_units('ZREM', key, fmt(x), y - z + 1, y)
  end
end
return 1
