
local limits = {}
local a = 3
for l = 1, tonumber(ARGV[2]) do
  local algo, p1, p2, p3 = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]),
    tonumber(ARGV[a + 3])
  -- The penalty: refusals, window, first block, longest block (0 refusals: none).
  local penalty = {tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]),
    tonumber(ARGV[a + 7])}
  if algo == 2 then
    -- The client declared the keys of its current window (index p3) and the next; before
    -- anything is written, the window that holds now must be one of them.
    local shift = idiv(now, p1) - p3
    if shift ~= 0 and shift ~= 1 then
      return redis.error_reply('TOLLGATE_WINDOW ' .. fmt(now))
    end
    p3 = shift
  end
  limits[l] = {algo, p1, p2, p3, penalty}
  a = a + 8
end
-- Each key's sanctions (tollgate_engine's `Sanction`), read once per call: refusals, the
-- window's end, the block's end, strikes, until when they are remembered, the deny's end.
local sanctions = {}
local function sanction_of(key)
  local sc = sanctions[key]
  if sc == nil then
    sc = {0, 0, 0, 0, 0, 0}
    -- Not declared: while its slot moves, the node may not serve it (an error, read as none).
    local v = redis.pcall('GET', key)
    if type(v) == 'string' then
      local n = 0
      for x in string.gmatch(v, '%d+') do
        n = n + 1
        sc[n] = tonumber(x)
      end
      -- Its times (the window's, the block's, the memory's and the deny's ends) at most
      -- `MAX_AHEAD` away: a time left is then always a figure the client reads.
      for k = 2, 6 do
        if k ~= 4 then sc[k] = within(sc[k], now) end
      end
    end
    sanctions[key] = sc
  end
  return sc
end
-- Counts a refusal toward `p` (Sanction::refused) and writes the sanctions; the block's
-- length if it starts one.
local function refused(key, sc, p)
  local block
  if sc[2] <= now then sc[1], sc[2] = 0, now + p[2] end
  sc[1] = sc[1] + 1
  if sc[1] >= p[1] then
    local strikes = 0
    if sc[5] > now then strikes = sc[4] + 1 end
    block = p[3] * 2 ^ strikes
    if block > p[4] then block = p[4] end
    sc[1], sc[2], sc[3], sc[4], sc[5] = 0, 0, now + block, strikes, now + block + p[4]
  end
  local last = math.max(sc[2], sc[3], sc[5], sc[6])
  redis.pcall('SET', key, fmt(sc[1]) .. ':' .. fmt(sc[2]) .. ':' .. fmt(sc[3]) .. ':' ..
    fmt(sc[4]) .. ':' .. fmt(sc[5]) .. ':' .. fmt(sc[6]), 'PX', ttl_ms(last - now))
  return block
end
-- The requests: sizes, check numbers and key numbers, decoded in one call.
local packed = ARGV[a]
-- The call's keys, and whether each must be read before anything is written (see
-- `keys_after` in `keys_declared.lua` and `keys_cross_slot.lua`).
local K, verify = keys_after(a)
local figures = #packed / 8
local fig = {struct.unpack('<' .. string.rep('d', figures), packed)}
local i = 1
-- The reply, and the index of its last figure.
local out, o = {now}, 1
-- The state of every GCRA and fixed-window key this call touched, read once and written once
-- at the end: requests that share a key (a hot client, a tenant) cost one GET and one write
-- per call, not per request. `false` stands for a key with no state. `written` lists the keys
-- to write, in order; `ttl` holds a written window's TTL, `false` a GCRA key's.
local state, first, written, ttl = {}, {}, {}, {}
-- The emission interval each GCRA key's TAT in `state` is counted in, when its sanctions end
-- and when its run began, as its value says (see `read_tat`).
local t_of, h_of, s_of = {}, {}, {}
-- The slots held per concurrency key, counted at its first check in the call.
local in_flight = {}
local function read(key, missing)
  local v = state[key]
  if v == nil then
    v = tonumber(redis.call('GET', key) or '') or missing
    state[key], first[key] = v, v
  end
  return v
end
-- What each admitting check of the current request would write: algorithm, key, value, TTL
-- (of a window), and where a sliding log's reply takes the sequence number the write makes.
local w_algo, w_key, w_val, w_ttl, w_seq = {}, {}, {}, {}, {}
-- Whether a sliding log's write must cut it to LOG_ENTRIES (kept longer than its period).
local w_cut = {}
-- Keys of several slots (the cross-slot form): a key whose slot this node does not serve
-- (the slot moved, or is moving and the key is not here) fails the command that reads it, and
-- with it the call. Every key is read first, before anything is written, so that such a call
-- has written nothing and its checks can be sent again: every key the call may write is
-- read. GCRA and fixed-window keys are read here for the checks below; other keys cost one
-- `EXISTS` each (a sliding log two: its log and its sequence).
if verify then
  local v, seen = 1, {}
  while v <= figures do
    local n = fig[v]
    v = v + 1
    for _ = 1, n do
      local limit, k = limits[fig[v] % 1024 + 1], fig[v + 1]
      v = v + 2
      local algo = limit[1]
      if algo == 4 then v = v + 3 end
      if not seen[k] then
        seen[k] = true
        local key = K[k]
        if algo == 1 then
          if state[key] == nil then
            local tat
            tat, t_of[key], h_of[key], s_of[key] = read_tat(key)
            state[key], first[key] = tat, tat
          end
        elseif algo == 2 then
          read(K[k + limit[4]], 0)
        else
          redis.call('EXISTS', key)
          -- A sliding log also writes its sequence, which may have moved on its own.
          if algo == 3 then redis.call('EXISTS', K[k + 1]) end
        end
      end
    end
  end
end
while i <= figures do
  local n = fig[i]
  i = i + 1
  o = o + 1
  local head = o
  out[head] = 0
  local admits = true
  for j = 1, n do
    w_algo[j] = 0
    local code, k = fig[i], fig[i + 1]
    local key = K[k]
    i = i + 2
    local l = code % 1024
    code = (code - l) / 1024
    local enforce = code % 2 == 1
    local cost = (code - code % 2) / 2
    local limit = limits[l + 1]
    local algo, p1, p2, p3 = limit[1], limit[2], limit[3], limit[4]
    local status = 0
    local slot
    if algo == 4 then
      -- A concurrency check also carries its request's slot id, in three parts.
      slot = fmt(fig[i]) .. '-' .. fmt(fig[i + 1]) .. '-' .. fmt(fig[i + 2])
      i = i + 3
    end
    -- The key's sanctions live at `<base>:pb`, in the slot of its algorithm's keys but not
    -- declared: during a slot's migration a call that declares a key missing on the node
    -- is refused (TRYAGAIN), and most keys have no sanctions. While the slot moves, the node
    -- that serves the call after an ASK cannot read them, and the call goes on without them.
    -- A deny, then a block, refuses it
    -- (status 4, 3) whatever its cost, and the figure after the status (a sliding log's
    -- reset and retry) is the time to its end.
    local skey = string.match(key, '^(.*):[^:]*$') .. ':pb'
    local sc = sanction_of(skey)
    local at = o
    if sc[6] > now or sc[3] > now then
      local left = sc[3] - now
      status = 3
      if sc[6] > now then status, left = 4, sc[6] - now end
      if algo == 3 then
        out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = status, 0, left, left, 0
        o = o + 5
      else
        out[o + 1], out[o + 2] = status, left
        o = o + 2
      end

    elseif algo == 1 then
      local interval, burst, tolerance = p1, p3, p2
      local tat = state[key]
      if tat == nil then
        tat, t_of[key], h_of[key], s_of[key] = read_tat(key)
        state[key], first[key] = tat, tat
      end
      -- Written under another quota (a plan, a reload): carry what the key used.
      tat = carry(tat, t_of[key], interval, now)
      local base = now
      if tat and tat > now then base = tat end
      local new_tat = base + interval * cost
      if cost > burst then
        status = 2
      elseif new_tat - now > tolerance then
        status = 1
      else
        w_algo[j], w_key[j], w_val[j], w_ttl[j] = 1, key, new_tat, interval
      end
      out[o + 1], out[o + 2] = status, tat or 0
      o = o + 2

    elseif algo == 2 then
      local period, limit = p1, p2
      local index = idiv(now, period)
      local wkey = K[k + p3]
      local count = read(wkey, 0)
      if cost > limit then
        status = 2
      elseif count + cost > limit then
        status = 1
      else
        w_algo[j], w_key[j], w_val[j], w_ttl[j] = 2, wkey, cost, (index + 1) * period - now
      end
      out[o + 1], out[o + 2] = status, count
      o = o + 2

    elseif algo == 3 then
      -- The log keeps its entries for `keep`, the longest period of the limit's quotas.
      local period, limit, keep = p1, p2, p3
      local remaining, reset, retry = 0, 0, 0
      local log = key
      -- An entry at t counts while t + period > now.
      local oldest = fmt(now - period)
      local count = redis.call('ZCOUNT', log, '(' .. oldest, '+inf')
      if limit > count then remaining = limit - count end
      if count > 0 then
        local newest = redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')
        reset = tonumber(newest[2]) + period - now
      end
      if cost > limit then
        status = 2
      elseif count + cost > limit then
        local nth = redis.call('ZRANGEBYSCORE', log, '(' .. oldest, '+inf', 'WITHSCORES',
          'LIMIT', count + cost - limit - 1, 1)
        status, retry = 1, tonumber(nth[2]) + period - now
      else
        -- A request of no units leaves the log's own reset (0 for an empty log).
        remaining = limit - count - cost
        if cost > 0 then reset = period end
        w_algo[j], w_key[j], w_val[j], w_ttl[j], w_seq[j] = 3, k, cost, keep, o + 5
        w_cut[j] = keep > period
      end
      out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = status, remaining, reset, retry, 0
      o = o + 5

    elseif algo == 4 then
      local ttl, limit = p1, p2
      -- The slots held: a slot's score is its deadline, and one past it is gone (its holder
      -- crashed, or stopped renewing it). Counted once per call and key, then kept up to date.
      local held = in_flight[key]
      if held == nil then
        redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now))
        held = redis.call('ZCARD', key)
        in_flight[key] = held
      end
      if cost > limit then
        status = 2
      elseif held + cost > limit then
        status = 1
      else
        w_algo[j], w_key[j], w_val[j], w_ttl[j] = 4, key, slot, ttl
      end
      out[o + 1], out[o + 2] = status, held
      o = o + 2

    else
      return redis.error_reply('tollgate: unknown algorithm ' .. tostring(algo))
    end

    local penalty = limit[5]
    if status == 1 and enforce and penalty[1] > 0 then
      local block = refused(skey, sc, penalty)
      if block then
        out[at + 1] = 3
        if algo == 3 then out[at + 3], out[at + 4] = block, block else out[at + 2] = block end
        if algo == 1 then
          -- A GCRA key's value says until when it has sanctions (see `read_tat`).
          h_of[key] = math.max(h_of[key], sc[3], sc[6])
          if ttl[key] == nil then ttl[key] = false; written[#written + 1] = key end
        end
      end
    end
    -- A deny by hand refuses under a shadow limit too: it is an operator's decision.
    if status ~= 0 and (enforce or status == 4) then admits = false end
  end

  if admits then
    for j = 1, n do
      local algo, key = w_algo[j], w_key[j]
      if algo == 1 then
        state[key], t_of[key] = w_val[j], w_ttl[j]
        if ttl[key] == nil then ttl[key] = false; written[#written + 1] = key end
      elseif algo == 2 then
        state[key] = state[key] + w_val[j]
        if ttl[key] == nil then ttl[key] = w_ttl[j]; written[#written + 1] = key end
      elseif algo == 3 then
        -- Trimmed and expired by the longest period of the limit's quotas, not the check's:
        -- a plan of a longer period still counts the older units.
        local cost, keep, log, seq_key = w_val[j], w_ttl[j], K[key], K[key + 1]
        redis.call('ZREMRANGEBYSCORE', log, '-inf', now - keep)
        local last = redis.call('INCRBY', seq_key, cost)
        -- A unique member per unit (two units in the same microsecond are two entries).
        log_units('ZADD', log, fmt(now), last - cost + 1, last)
        -- At most LOG_ENTRIES, the newest: only a log kept longer than its check's period can
        -- hold more (a short plan's units over a long plan's period).
        if w_cut[j] then redis.call('ZREMRANGEBYRANK', log, 0, -LOG_ENTRIES - 1) end
        redis.call('PEXPIRE', log, ttl_ms(keep))
        redis.call('PEXPIRE', seq_key, ttl_ms(keep))
        out[w_seq[j]] = last
      elseif algo == 4 then
        local slot_ttl = w_ttl[j]
        redis.call('ZADD', key, fmt(now + slot_ttl), w_val[j])
        redis.call('PEXPIRE', key, ttl_ms(slot_ttl))
        in_flight[key] = in_flight[key] + 1
      end
    end
    out[head] = 1
  end
end
for i = 1, #written do
  local key = written[i]
  local v, window_ttl = state[key], ttl[key]
  if not window_ttl then
    -- A GCRA TAT lives until it is in the past (and the key's sanctions are over).
    -- The run goes on while the TAT this call read was ahead (`run_of`).
    write_tat(key, v, t_of[key], h_of[key], run_of(first[key], s_of[key], now), now)
  else
    -- A window's count: its TTL (the time to the window's turn) is set by its first write.
    redis.call('INCRBY', key, fmt(v - first[key]))
    if first[key] == 0 then redis.call('PEXPIRE', key, ttl_ms(window_ttl)) end
  end
end
return struct.pack('<' .. string.rep('d', o), unpack(out, 1, o))
