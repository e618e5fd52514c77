"""``POST /v1/messages`` (Anthropic's Messages API) on the chat path, as vLLM serves it:
a Messages request becomes the chat request it means (:mod:`.convert`), the chat
frontend renders, plans tools, samples and splits thinking from it, and the chat
updates become Anthropic content blocks and stream events (:mod:`.build`,
:mod:`.stream`). Errors on these routes take Anthropic's shape (:mod:`.errors`);
``POST /v1/messages/count_tokens`` counts a request's prompt tokens."""
