"""Serving: the OpenAI-compatible server, KV caches, guards and the LDP cache."""
