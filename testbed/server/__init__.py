"""The OpenAI-compatible server in front of the real cluster (`python -m testbed.serve_http`): the
aiohttp app (app.py) and the router that takes requests as they come (live.py). It starts a real
cluster, so it sits above the executors; testbed/http is the client side, the third executor."""
