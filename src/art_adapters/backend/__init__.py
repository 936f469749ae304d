"""Backends: the Backend protocol, LocalBackend (vLLM + trainer here), RemoteBackend and the `serve` HTTP server."""
