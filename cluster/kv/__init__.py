"""KV blocks beyond one engine's memory: stable block hashes (`hashing`), the events that
tell a router which blocks a worker holds (`events`), and the disk tier (`disk_store`).

No MLX here: the router imports `hashing` and `events` too.
"""
