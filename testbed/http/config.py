"""The `http` config group: the client side of `executor=http` and the server of `python -m testbed.serve_http`.

Not frozen, like the other Hydra groups merged from YAML (see testbed/workload/config.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from testbed.errors import ConfigError

PROMPTS = ("ids", "text")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Where a key can come from instead of the command line (which Hydra stores in .hydra/): the
# client takes the variable OpenAI clients and vLLM's benchmark read, the server its own.
CLIENT_KEY_ENV, SERVER_KEY_ENV = "OPENAI_API_KEY", "TESTBED_API_KEY"


@dataclass
class HttpConfig:
    # -- executor=http: the endpoint the workload is replayed against -------------------------
    url: Optional[str] = None  # base URL, e.g. http://127.0.0.1:8000 (the path below is appended)
    endpoint: str = "/v1/completions"  # path appended to url: an OpenAI-style completions endpoint
    model: Optional[str] = None  # the `model` field sent; None: the first id of GET /v1/models
    prompt: str = "ids"  # ids: prompts as token ids; text: text of the workload's lengths
    tokenizer: Optional[str] = None  # a tokenizer directory for prompt=text (default: model.path)
    max_concurrency: int = 256  # requests in flight at once; later arrivals wait (their TTFT grows)
    timeout_s: float = 600.0  # one request, from sending to its last chunk
    stall_timeout_s: float = 60.0  # the longest silence between two chunks of a stream
    connect_timeout_s: float = 10.0  # the longest wait to open a connection (s)
    ignore_eos: bool = True  # vLLM/SGLang extensions that make the output length the workload's
    min_tokens: bool = True  # send min_tokens = the request's output length (vLLM/SGLang extension)
    token_ids: bool = True  # ask for the generated ids (`return_token_ids`, vLLM); else count chunks
    label: str = "http"  # the configuration's name in a study's tables and figures
    num_gpus: int = 1  # GPUs behind the endpoint: the per-GPU figures divide by it
    # -- both sides ------------------------------------------------------------------------------
    api_key: Optional[str] = None  # client: sent as a bearer token; server: required when set
    # -- python -m testbed.serve_http ------------------------------------------------------------
    host: str = "127.0.0.1"  # any other interface needs api_key
    port: int = 8000  # 0: a free port, printed at start
    max_streams: int = 64  # concurrent requests the server takes; more get 429
    # open connections the server holds (lowered to what `ulimit -n` leaves): past it the oldest
    # connection with no request under way is closed, and with none such the newcomer gets 503
    max_connections: int = 256
    header_timeout_s: float = 10.0  # a connection with no whole request header for this long is closed
    body_timeout_s: float = 30.0  # a request body not read whole within this gets 408
    served_model: str = "testbed"  # the id /v1/models lists

    def validate(self) -> "HttpConfig":
        if self.prompt not in PROMPTS:
            raise ConfigError(f"http.prompt must be one of {', '.join(PROMPTS)} (got {self.prompt!r})")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"http.url must start with http:// or https:// (got {self.url!r})")
        if not self.endpoint.startswith("/"):
            raise ConfigError(f"http.endpoint must be a path starting with / (got {self.endpoint!r})")
        for key in ("max_concurrency", "max_streams", "max_connections", "num_gpus"):
            if getattr(self, key) < 1:
                raise ConfigError(f"http.{key} must be >= 1 (got {getattr(self, key)})")
        for key in ("timeout_s", "stall_timeout_s", "connect_timeout_s", "header_timeout_s", "body_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"http.{key} must be > 0 (got {getattr(self, key)})")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"http.port must be in 0..65535 (got {self.port})")
        if not self.label:
            raise ConfigError("http.label must be a non-empty name")
        return self

    def client_key(self) -> Optional[str]:
        return self.api_key or os.environ.get(CLIENT_KEY_ENV) or None

    def server_key(self) -> Optional[str]:
        return self.api_key or os.environ.get(SERVER_KEY_ENV) or None

    def check_server(self) -> None:
        """A server reachable from other hosts must not be open to them."""
        if self.host not in LOOPBACK and not self.server_key():
            raise ConfigError(
                f"http.host={self.host} listens beyond this machine: set http.api_key or {SERVER_KEY_ENV} (clients "
                f"send it as `Authorization: Bearer KEY`), or keep http.host=127.0.0.1"
            )

    def check_client(self) -> None:
        if not self.url:
            raise ConfigError(
                "executor=http needs http.url, the server's base URL (e.g. http.url=http://127.0.0.1:8000)"
            )
