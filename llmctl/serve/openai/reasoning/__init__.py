"""Reasoning output: a reasoning model's thinking split from its answer
(``--reasoning-parser``). :mod:`.split` splits one choice's output; :mod:`.parsers`
holds the parsers by name and what each decides for a request."""
