-- wrk: every request retries one finished charge: replays (run one request first).
-- curl … -H 'Idempotency-Key: load-replay' …; wrk -t2 -c16 -d10s -s examples/load/replay.lua http://127.0.0.1:3000
wrk.method = "POST"
wrk.path = "/v1/charges"
wrk.headers["Authorization"] = "Bearer acct_load"
wrk.headers["Idempotency-Key"] = "load-replay"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"amount": 500, "currency": "usd", "customer": "cus_load"}'

function response(status, headers, body)
  if status ~= 201 then
    print("unexpected status " .. status)
  end
end
