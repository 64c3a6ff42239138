"""Load generation and serving benchmarks (`orchard bench`, `load/bench_serve.py`).

- `datasets`: what to send (random, prefix-repetition, text slices, custom JSONL)
- `backends`: how to send one request and time it (gRPC SDK, OpenAI HTTP)
- `metrics`: client-side latency and throughput from the timed requests
- `server_metrics`: the target's Prometheus `/metrics` before, during and after a run
- `plot`: a PNG a person can look at
- `serve`: arrivals, the run, the printed report and the JSON result
"""
