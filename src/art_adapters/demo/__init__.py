"""`art-adapters demo`: `agent.py` (an ordinary LangGraph agent, nothing of ours imported), `run.py` (its training),
`orders.py` (the task), `steps.py` (shared machinery), `tool_choice.py` (the earlier hand-written task)."""
