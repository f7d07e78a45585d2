"""ServerLimits: what one request may ask for, and how long shutdown waits; one frozen dataclass of defaults."""

from __future__ import annotations

import dataclasses

from llmc.chat_template import DEFAULT_LIMITS, TemplateLimits


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for; past a limit it gets a 4xx naming it. The defaults suit a public endpoint."""

    max_body_bytes: int = 4 << 20  # 413 past it; a context of 128K token ids is about 1 MB of JSON
    max_n: int = 16  # choices per request: each is a sequence in the engine
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_stop_token_ids: int = 256  # stop token ids per request (each sequence checks every generated token)
    max_waiting_requests: int = 256  # sequences (n per request) in flight beyond max_num_seqs; 429 past it
    retry_after_s: int = 1  # the Retry-After a 429 sends
    parse_off_loop_bytes: int = 64 << 10  # bodies larger than this are parsed in a worker thread
    tokenize_on_loop_chars: int = 4 << 10  # longer prompts are tokenized on the server's tokenizer threads
    tokenizer_threads: int = 2  # those threads: long prompts queue there, never on the pool other requests use
    header_timeout_s: float = 10.0  # a connection's request line and headers must arrive within this (`serve`)
    body_timeout_s: float = 30.0  # a request's whole body must arrive within this; 408 past it
    max_connections: int = 512  # open connections (`serve`); a request on one past it gets 503
    # an idle kept-alive connection closes after this (`serve`); past clients' own idle expiry (httpx 5 s,
    # aiohttp 15 s), or a client sends its next request as the server closes the connection and gets no answer
    keep_alive_s: float = 75.0
    chat_template: TemplateLimits = DEFAULT_LIMITS  # time and size bounds of the checkpoint's chat template
    shutdown_timeout_s: float = 30.0  # after SIGTERM, requests in flight get this long to finish (`serve`)
