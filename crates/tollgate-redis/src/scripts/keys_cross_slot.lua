-- The cross-slot form (`allow-cross-slot-keys`): one key declared, by which the call is
-- routed to its node, and the others after the packed checks (the last argument `a`). They
-- may hash to other slots of the same node, and nothing checked that the node serves them.
local function keys_after(a)
  local keys = {KEYS[1]}
  for x = a + 1, #ARGV do
    keys[#keys + 1] = ARGV[x]
  end
  return keys, true
end
