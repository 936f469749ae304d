"""Adapters: one decorator per agent framework, all built on `capture` (imported on first use, so this is light)."""

from __future__ import annotations

from .base import Route, current_route, finalize, scope, wrap_rollout

__all__ = ["Route", "current_route", "finalize", "scope", "wrap_rollout"]
