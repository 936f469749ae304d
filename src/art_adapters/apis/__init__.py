"""Other APIs vLLM serves, seen as chat completions (the data contract reads every call in chat form)."""
