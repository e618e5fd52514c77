"""Finished responses kept in memory for ``previous_response_id`` and
``GET /v1/responses/{id}``: a bounded LRU (``--responses-store-size``; 0 keeps none), so
a server taking responses forever holds a fixed number of conversations. Nothing is
written to disk: a restart forgets them, and a follow-up naming one gets a 404."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class Stored:
    """A response, and the conversation it ends: the items that led to it (its
    predecessors' and its own input) and its output items, as they go back in."""

    response: dict[str, Any]
    history: list  # input items (llmctl.serve.openai.responses_api.protocol), in order
    owner: str | None = None  # the tenant that made it (API keys); only it may read it


class ResponseStore:
    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()
        # the event loop and worker threads (off-loop rendering) both read it
        self._lock = threading.Lock()

    def put(self, stored: Stored) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[stored.response["id"]] = stored
            self._items.move_to_end(stored.response["id"])
            while len(self._items) > self.size:
                self._items.popitem(last=False)  # the least recently used

    def get(self, response_id: str, owner: str | None = None) -> Stored | None:
        """The stored response, now the most recently used; None: unknown, evicted or
        another tenant's (whose ids are not to be confirmed either)."""
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None and stored.owner != owner:
                return None
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def __len__(self) -> int:
        return len(self._items)
