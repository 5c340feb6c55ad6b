"""A minimal OpenAI chat-completions client over httpx (the upstream "cloud" LLM)."""

from __future__ import annotations

import httpx


class UpstreamError(RuntimeError):
    """The upstream call failed. ``sent`` says whether the request may have reached it."""

    def __init__(self, message: str, sent: bool, status: int | None = None):
        super().__init__(message)
        self.sent = sent
        self.status = status


def _base(url: str) -> str:
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/v1"):
        url = url.removesuffix(suffix)
    return url.rstrip("/")


class OpenAIUpstream:
    """POST {url}/v1/chat/completions; ``model`` defaults to the first id the upstream lists."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, transport: httpx.BaseTransport | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"upstream URL must start with http:// or https://, got {url!r}")
        self.url = _base(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)
        self._model = model

    def models(self) -> list[str]:
        try:
            r = self.client.get("/v1/models")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise UpstreamError(f"cannot list models at {self.url}/v1/models: {e}", sent=False) from e
        return [m["id"] for m in r.json().get("data", [])]

    @property
    def model(self) -> str:
        if self._model is None:
            ids = self.models()
            if not ids:
                raise UpstreamError(f"the upstream {self.url} lists no models", sent=False)
            self._model = ids[0]
        return self._model

    def chat(self, messages: list[dict], **params) -> dict:
        """The upstream's chat.completion object (a dict)."""
        body = {"model": params.pop("model", None) or self.model, "messages": messages, **params}
        body.pop("stream", None)
        try:
            r = self.client.post("/v1/chat/completions", json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise UpstreamError(f"cannot reach the upstream at {self.url}: {e}", sent=False) from e
        except httpx.HTTPError as e:
            raise UpstreamError(f"upstream request failed: {e}", sent=True) from e
        if r.status_code != 200:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:300]
            raise UpstreamError(f"upstream answered {r.status_code}: {msg}", sent=True, status=r.status_code)
        return r.json()

    def __call__(self, messages: list[dict], **params) -> str:
        return self.chat(messages, **params)["choices"][0]["message"]["content"] or ""

    def close(self) -> None:
        self.client.close()
