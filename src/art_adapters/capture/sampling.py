"""Which request settings change the distribution a token was sampled from beyond temperature, which the trainer
reproduces; tokens sampled under any other are excluded from the importance ratio (see training/loss.py)."""

from __future__ import annotations

from typing import Any


def unreproducible_settings(request: dict[str, Any]) -> list[str]:
    """The request's sampling settings the trainer cannot reproduce (vLLM's processed logprobs include them)."""
    found: list[str] = []

    def differs(key: str, neutral: Any, *, also: tuple[Any, ...] = ()) -> None:
        value = request.get(key)
        if value is not None and value != neutral and value not in also:
            found.append(key)

    differs("top_p", 1, also=(1.0,))
    differs("top_k", -1, also=(0,))
    differs("min_p", 0, also=(0.0,))
    differs("presence_penalty", 0, also=(0.0,))
    differs("frequency_penalty", 0, also=(0.0,))
    differs("repetition_penalty", 1, also=(1.0,))
    differs("min_tokens", 0)
    for key in (
        "logit_bias",
        "bad_words",
        "allowed_token_ids",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ):
        if request.get(key):
            found.append(key)
    response_format = request.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in _GRAMMARS:
        found.append("response_format")
    text = request.get("text")  # the Responses API's output format
    text_format = text.get("format") if isinstance(text, dict) else None
    if isinstance(text_format, dict) and text_format.get("type") in _GRAMMARS:
        found.append("text.format")
    tool_choice = request.get("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        found.append("tool_choice")
    if any(_strict(tool) for tool in request.get("tools") or []):
        found.append("strict tools")  # vLLM enforces their schema once the model opens a tool call
    return found


_GRAMMARS = ("json_object", "json_schema", "structural_tag")


def _strict(tool: Any) -> bool:
    """A function tool with `"strict": true`, in chat form (`function.strict`) or Responses form (`strict`)."""
    if not isinstance(tool, dict):
        return False
    function = tool.get("function")
    return tool.get("strict") is True or (isinstance(function, dict) and function.get("strict") is True)


def sampling_note(request: dict[str, Any]) -> dict[str, Any]:
    """What a hand-built Choice must carry to be trained against the right distribution."""
    temperature = request.get("temperature")
    return {
        "temperature": 1.0 if temperature is None else float(temperature),
        "unreproducible": unreproducible_settings(request),
    }
