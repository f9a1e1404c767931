"""The errors `hf-paged serve` reports: a request it refuses (an HTTP 4xx), and a setup it cannot serve from."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the server refuses before it runs: answered with HTTP 400 and an OpenAI-style error body naming
    `param`, the request field at fault."""

    def __init__(self, message: str, param: str | None = None):
        self.message, self.param = message, param
        super().__init__(message)


class ServeUnavailable(RuntimeError):
    """`hf-paged serve` cannot start: serving packages are missing, or transformers' serving code lacks a seam the
    server plugs into (the message names the supported transformers range)."""
