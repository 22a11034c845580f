-- wrk script of benches/soak.sh: POST /api/chat for a flooding shop (half the requests), a hot
-- shop (a fifth) and MANY other shops (the rest), and per shop the admissions that were
-- limited ("limited":true), the bypasses ("limited":false), the 429s and 503s.
-- Run with as many connections as threads (-tN -cN): each thread has one connection, so a
-- response belongs to the request its thread sent last.
local many = tonumber(os.getenv("MANY") or "200")
local threads = {}

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  math.randomseed(os.time() * 1000 + id)
  admitted = {}
  bypassed = 0
  denied = 0
  unavailable = 0
  other = 0
  last = nil
end

function request()
  local r = math.random()
  if r < 0.5 then
    last = "flood.soak"
  elseif r < 0.7 then
    last = "hot.soak"
  else
    last = "shop-" .. math.random(1, many) .. ".soak"
  end
  return wrk.format("POST", "/api/chat", { ["x-shop-domain"] = last }, "")
end

function response(status, headers, body)
  if status == 200 then
    if string.find(body, '"limited":true', 1, true) then
      admitted[last] = (admitted[last] or 0) + 1
    else
      bypassed = bypassed + 1
    end
  elseif status == 429 then
    denied = denied + 1
  elseif status == 503 then
    unavailable = unavailable + 1
  else
    other = other + 1
  end
end

function done(summary, latency, requests)
  local totals = { bypassed = 0, denied = 0, unavailable = 0, other = 0 }
  local shops = {}
  for _, t in ipairs(threads) do
    for k, _ in pairs(totals) do
      totals[k] = totals[k] + t:get(k)
    end
    for shop, n in pairs(t:get("admitted")) do
      shops[shop] = (shops[shop] or 0) + n
    end
  end
  for k, v in pairs(totals) do
    io.write(string.format("total %s %d\n", k, v))
  end
  io.write(string.format("total requests %d\n", summary.requests))
  io.write(string.format("total socket_errors %d\n",
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
  io.write(string.format("total max_latency_us %d\n", latency.max))
  for shop, n in pairs(shops) do
    io.write(string.format("shop %s %d\n", shop, n))
  end
end
