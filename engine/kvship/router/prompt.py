"""What the picker reads from a request body: the model and the prompt's leading text, cut into
chained block hashes (a block's hash covers every block before it, as the engines' prefix cache does)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

# The rendered text is capped: the leading blocks decide the pick, and a huge body should not
# cost the picker more than this.
MAX_PREFIX_CHARS = 64 * 1024


@dataclass
class ParsedRequest:
    model: str | None = None
    text: str = ""
    block_hashes: list[bytes] = field(default_factory=list)
    tokenize: dict | None = None  # the /tokenize body that gives the engine's tokens for this prompt
    token_ids: list[int] | None = None  # a completion prompt given as token ids


def render(body: dict) -> str:
    """The prompt as text: a completion's prompt, or each chat message's role and content."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role', '')}>{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt if isinstance(prompt, str) else ""


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    """Hashes of each whole leading block of `block_chars` characters, each chained on the one before."""
    out: list[bytes] = []
    prev = b""
    text = text[:MAX_PREFIX_CHARS]
    for i in range(0, len(text) - block_chars + 1, block_chars):
        prev = hashlib.blake2b(prev + text[i:i + block_chars].encode(), digest_size=16).digest()
        out.append(prev)
    return out


def tokenize_body(body: dict, model: str | None) -> tuple[dict | None, list[int] | None]:
    """What the engine's /tokenize needs to give this prompt's tokens (or the ids themselves)."""
    if isinstance(body.get("messages"), list):
        return {"model": model, "messages": body["messages"]}, None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # several prompts: the first decides, as for the text
    if isinstance(prompt, str):
        return {"model": model, "prompt": prompt}, None
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, prompt
    return None, None


def parse(body: bytes, block_chars: int) -> ParsedRequest:
    """A body that is not a JSON object gives an empty request: the engine answers it with its own 4xx."""
    try:
        data = json.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError):
        return ParsedRequest()
    if not isinstance(data, dict):
        return ParsedRequest()
    model = data.get("model") if isinstance(data.get("model"), str) else None
    text = render(data)
    tokenize, token_ids = tokenize_body(data, model)
    return ParsedRequest(model=model, text=text, block_hashes=block_hashes(text, block_chars), tokenize=tokenize,
                         token_ids=token_ids)
