"""The OpenAI-compatible server in front of the real cluster (`python -m testbed.serve_http`): the
aiohttp app (app.py), the router that takes requests as they come (live.py), and what the HTTP path
adds to a run (bench.py). It starts a real cluster the way every real run does
(studies/real_cluster.py's start_cluster), so it sits above the studies layer; testbed/http is the
client side, the third executor."""
