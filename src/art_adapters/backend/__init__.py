"""Backends: where a model is served and trained (LocalBackend in this process, RemoteBackend on a server)."""
