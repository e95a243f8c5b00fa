-- common.lua: the helpers lua/decide.lua and lua/refund.lua share. Not a
-- script of its own: src/backends/redis/script.rs puts it in front of each
-- when embedding them, so each script is still one self-contained body
-- (EVALSHA cannot share code between scripts). In the function library the
-- same text is the body of a builder function, run once per server (see
-- script.rs): no line here may run a command or read KEYS and ARGV.

-- Globals read once: as a script, every call runs this whole body; in the
-- library, once per server.
local call, format, floor, gmatch, match = redis.call, string.format, math.floor, string.gmatch, string.match
local tonumber, ipairs, unpack, concat = tonumber, ipairs, unpack, table.concat
local pack = struct.pack

local TWO53 = 9007199254740992

local function fmt(n)
  return format('%d', n)
end

-- floor(a / b) for integers 0 <= a < 2^53, 0 < b < 2^53. Checked with exact
-- products rather than trusting the rounded quotient: for these ranges a
-- correctly rounded a / b never crosses an integer, but the guard costs two
-- multiplications and keeps the result right if a caller strays.
local function div(a, b)
  local q = floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- A key whose stored state this version will not read: the request fails
-- with this reason (the key and what was found) rather than misreading the
-- state. LAYOUT_REFUSED starts every such message, so that a batch can
-- tell this refusal from other failures (docs/redis.md, "Stored layouts").
local LAYOUT_REFUSED = 'throttlegate: stored layout refused'

-- A byte outside printable ASCII as \xNN: the error text is logged.
local function escape_byte(ch)
  return format('\\x%02x', string.byte(ch))
end

local function refuse_layout(key, what)
  local shown = string.gsub(string.sub(what, 1, 80), '[^\32-\126]', escape_byte)
  error(LAYOUT_REFUSED .. ' at ' .. key .. ': ' .. shown, 0)
end

-- The states of two and three integers (every layout there is) as one
-- match each, in place of a split into a table. Only a token bucket's
-- level (the first of its fields, `fields.signed`) may be negative: in
-- debt. Every key names its algorithm (src/backends/keys.rs), so no other
-- algorithm meets a bucket's state but by a foreign write.
local STATE_PATTERNS = {
  [2] = '^(%d+):(%d+)$', [3] = '^(%d+):(%d+):(%d+)$', signed = '^(-?%d+):(%d+):(%d+)$',
}

-- A field read back exactly: every version writes integers of magnitude
-- below 2^53, and a longer one would come back rounded.
local function exact(n)
  return n and n < TWO53 and -n < TWO53
end

-- A string state: its integers joined by ':', one per name of `fields`, in
-- order. nil when the key is absent.
local function load_fields(key, fields)
  local raw = call('GET', key)
  if not raw then
    return nil
  end
  local n = #fields
  local pattern = fields.signed and STATE_PATTERNS.signed or STATE_PATTERNS[n]
  if pattern then
    local a, b, c = match(raw, pattern)
    a, b, c = tonumber(a), tonumber(b), tonumber(c)
    if n == 2 and exact(a) and exact(b) then
      return { [fields[1]] = a, [fields[2]] = b }
    elseif n == 3 and exact(a) and exact(b) and exact(c) then
      return { [fields[1]] = a, [fields[2]] = b, [fields[3]] = c }
    end
  end
  -- Every version has written these states only as exactly these
  -- integers: anything else is no layout this version knows.
  refuse_layout(key, 'not ' .. fmt(n) .. ' integers: ' .. raw)
end

local function wrap_sub(a, b)
  if a >= b then
    return a - b
  end
  return (TWO53 - b) + a
end

-- The running total and the cost of a member of layout 1, or nil for
-- any other member (layout 0, "<µs>:<seq>", one per unit of cost: see
-- log_units in lua/decide.lua).
local function log_member(member)
  local e, cost = match(member, '^(%d+),(%d+)$')
  if not e then
    return nil
  end
  return tonumber(e), tonumber(cost)
end

local function integer(raw)
  local n = tonumber(raw)
  if n == nil or n < 0 or n >= TWO53 or n ~= floor(n) then
    return nil
  end
  return n
end

-- The arguments from argv[first] on, by the names of `fields`.
local function named_args(argv, fields, first)
  local out = {}
  for idx, name in ipairs(fields) do
    out[name] = argv[first + idx - 1]
  end
  return out
end

-- Each name of `fields` by its position: where a field sits in a layout.
local function positions(fields)
  local out = {}
  for idx, name in ipairs(fields) do
    out[name] = idx
  end
  return out
end

-- The call's time in µs: the header's now_us, or Redis TIME when it is
-- empty. nil when now_us is not an integer.
local function now_of(now_us)
  if now_us ~= '' then
    return integer(now_us)
  end
  -- Effects replication lets writes follow TIME on Redis < 7 (a no-op on 7).
  if redis.replicate_commands then
    redis.replicate_commands()
  end
  local time = call('TIME')
  return tonumber(time[1]) * 1000000 + tonumber(time[2])
end
