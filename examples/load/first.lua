-- wrk: every request is a new charge (a fresh Idempotency-Key): first executions.
-- wrk -t2 -c16 -d10s -s examples/load/first.lua http://127.0.0.1:3000
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end

local counter = 0
local prefix = ""

function init(args)
  -- Distinct per thread (id) and per run (time); math.random is seeded alike in every thread.
  prefix = tostring(os.time()) .. "-" .. tostring(id) .. "-"
end

function request()
  counter = counter + 1
  return wrk.format("POST", "/v1/charges", {
    ["Authorization"] = "Bearer acct_load",
    ["Idempotency-Key"] = prefix .. counter,
    ["Content-Type"] = "application/json",
  }, '{"amount": 500, "currency": "usd", "customer": "cus_load"}')
end

function response(status, headers, body)
  if status ~= 201 then
    print("unexpected status " .. status)
  end
end
