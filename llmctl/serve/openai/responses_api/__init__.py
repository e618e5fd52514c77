"""``POST /v1/responses`` (OpenAI's Responses API) on the chat path: a request's input
items become a chat conversation (:mod:`.convert`), the chat frontend renders, samples
and splits it, and the chat updates become Responses output items and stream events
(:mod:`.build`); finished responses are kept in a bounded store (:mod:`.store`) so a
follow-up can name its ``previous_response_id``."""
