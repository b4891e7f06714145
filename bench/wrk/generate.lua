-- wrk script: POST a non-streaming /generate body; print a JSON summary line at the end.
-- usage: wrk -t2 -c32 -d5s -s bench/wrk/generate.lua http://127.0.0.1:PORT
wrk.method = "POST"
wrk.path = "/generate"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"text": "The quick brown fox jumps over the lazy dog", '
  .. '"sampling_params": {"max_new_tokens": 16}}'

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "non2xx": %d, "connect": %d, "read": %d, '
      .. '"write": %d, "timeout": %d, "p50_us": %d, "p99_us": %d, "mean_us": %.1f}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
