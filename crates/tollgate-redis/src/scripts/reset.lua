-- A reset, in the same call as the `lift` of `sanction.lua` that follows it: the key's values
-- go, then its sanctions are lifted (a deny stays and, on a GCRA key, its end is written back
-- into the value: no moment, and no failed second call, leaves a denied key without it).
-- KEYS[1]: the key's `:pb`; KEYS[2..]: its values (a GCRA key's `:v3`, a log's `:log`, or a
-- fixed window's windows ARGV[5] to ARGV[5] + 3). ARGV: `lift`, 0, the algorithm (`gcra`,
-- `window`, `log`), the period in microseconds, the first window's index. A fixed window
-- whose current or next window is not among those declared answers `TOLLGATE_WINDOW <now>`.
do
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if ARGV[3] == 'window' then
    local k = idiv(now, tonumber(ARGV[4])) - tonumber(ARGV[5])
    if k < 0 or k > 2 then
      return redis.error_reply('TOLLGATE_WINDOW ' .. fmt(now))
    end
  end
  for i = 2, #KEYS do
    redis.call('DEL', KEYS[i])
  end
end
