"""The target's chat template, applied exactly as serving applies it: the one place conversations are rendered.

- `chat_token_ids`: a conversation ready for the assistant's next turn, as the server tokenizes it
  (`apply_chat_template(..., add_generation_prompt=True)`): datagen's prompts, verify's and the benchmark's.
- `tokenize_conversation`: (input_ids, loss_mask) of a whole conversation, mask 1 on every assistant turn's
  content and its end-of-turn token, 0 on system/user/template tokens. Derived by rendering prefixes of
  the conversation with the template itself; templates for which that is not well defined are refused (a
  mask shifted by one token trains the draft on the wrong targets).
- `user_turn_prefix`: the template rendered up to where the user's next words begin (Magpie-style
  synthetic prompts, steps/lib/data/synthetic.py: the target writes the user's turn itself).
"""

from __future__ import annotations

from typing import Any

#: a marker no template produces, cut out of a render to find where a turn's content begins.
CONTENT_MARK = "\u2063EAGLENEST-CONTENT\u2063"


def render(tokenizer: Any, messages: list[dict[str, str]], *, gen_prompt: bool = False) -> str:
    """The conversation as text in the target's chat template (with the assistant's header when `gen_prompt`)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A prompt in the target's chat template, ready for the assistant's turn, as token ids."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):        # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def user_turn_prefix(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The template rendered through `messages` and the header of the next user turn, up to its first word.

    What a served conversation looks like just before the user types: the template's own default system
    prompt is in it when `messages` has none (SmolLM2's, Qwen's)."""
    full = render(tokenizer, [*messages, {"role": "user", "content": CONTENT_MARK}])
    if full.count(CONTENT_MARK) != 1:
        raise template_error(tokenizer, "a user turn's content is not rendered verbatim once")
    prefix = full[: full.index(CONTENT_MARK)]
    if messages and not prefix.startswith(render(tokenizer, messages)):
        raise template_error(tokenizer, "rendering a new user turn rewrites the earlier turns")
    return prefix


def special_tokens(tokenizer: Any) -> list[str]:
    """Every special token's text, longest first (the first one a text starts with is the longest match)."""
    added = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
    return sorted(set(tokenizer.all_special_tokens) | set(added), key=len, reverse=True)


def template_error(tokenizer: Any, problem: str) -> ValueError:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return ValueError(f"chat template of tokenizer {name!r}: {problem}; the loss mask cannot be derived "
                      "from it. Use a template whose renders of a conversation's prefixes are prefixes of "
                      "each other and which closes every assistant turn with a special end-of-turn token.")


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): mask 1 on each assistant turn's content and its end-of-turn token.

    Rendering the first k messages (with the generation prompt before an assistant turn) must be a
    prefix of rendering k+1; the text between is tokenized segment by segment, as the server saw it
    (prompt tokens, then the generated ones).
    """
    ids: list[int] = []
    mask: list[int] = []

    def extend(text: str, value: int) -> None:
        new = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids.extend(new)
        mask.extend([value] * len(new))

    done = ""
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        head, full = render(tokenizer, messages[:k], gen_prompt=True), render(tokenizer, messages[: k + 1])
        if not head.startswith(done):
            raise template_error(tokenizer, f"rendering messages[:{k}] is not a prefix-extension of the "
                                 "previous render (the template rewrites earlier turns)")
        if not full.startswith(head + msg["content"]):
            raise template_error(tokenizer, f"messages[{k}] (assistant) is not rendered verbatim right after "
                                 "the generation prompt (the template trims or rewrites assistant content)")
        tail = full[len(head) + len(msg["content"]):]
        eot = next((s for s in special_tokens(tokenizer) if tail.startswith(s)), None)
        if eot is None:
            raise template_error(tokenizer, f"assistant turn {k} is followed by {tail[:20]!r}, "
                                 "not by a special end-of-turn token")
        extend(head[len(done):], 0)
        extend(msg["content"] + eot, 1)
        extend(tail[len(eot):], 0)
        done = full
    rest = render(tokenizer, messages)
    if not rest.startswith(done):
        raise template_error(tokenizer, "rendering the whole conversation is not an extension of its prefix")
    extend(rest[len(done):], 0)
    return ids, mask
