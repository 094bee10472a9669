"""`LLM.chat` (vLLM's): conversations in OpenAI's message format through the checkpoint's chat template, as the
server's /v1/chat/completions renders them (launch/frontend/tokens.py's chat_text, the same message checks), then
`generate`. The output is the model's text as generated: no reasoning or tool-call parsing (as vLLM's)."""
from __future__ import annotations

from pydantic import ValidationError

from models.checkpoint import read_chat_template

__all__ = ["chat_prompts"]


def chat_prompts(llm, messages, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                 chat_template: str | None = None) -> list[dict]:
    """One conversation (a list of message dicts), or each of a list of them, as vLLM's TokensPrompt: its token ids
    and the rendered text (RequestOutput.prompt, as vLLM's chat returns it); a ValueError naming what is wrong (a
    message's field, the options, a template that rejects them). chat_template: this call's (a template or its
    file's path), else the tokenizer's."""
    from .frontend.chat import ChatCompletionRequest
    from .frontend.protocol import APIError
    from .frontend.tokens import chat_text

    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages={messages!r} is not a conversation: pass a list of message dicts (or a list "
                         f"of such lists)")
    template = None if chat_template is None else read_chat_template(chat_template)
    if llm.tokenizer is None:
        raise ValueError(f"model {llm.config.model!r} has no tokenizer to render chats with; pass prompts to "
                         f"generate()")
    if template is None and not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError(f"model {llm.config.model!r} has no tokenizer chat template; pass chat_template, or prompts "
                         f"to generate()")
    conversations = list(messages) if isinstance(messages[0], (list, tuple)) else [messages]
    out = []
    for i, conversation in enumerate(conversations):
        where = "messages" if len(conversations) == 1 else f"messages[{i}]"
        try:
            body = ChatCompletionRequest(messages=conversation, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         chat_template_kwargs=chat_template_kwargs)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(x) for x in first.get("loc", ()))
            raise ValueError(f"{where}: {field}: {first['msg']}") from e
        try:
            if problems := body.unsupported():
                raise APIError(400, problems[0][1], problems[0][0])
            text = chat_text(llm.tokenizer, body, llm.config.model, continue_final_message, template)
            out.append({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False), "prompt": text})
        except APIError as e:
            raise ValueError(f"{where}: {e.message}") from e
    return out
