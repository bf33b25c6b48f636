"""Deferred admission (``ServeConfig.defer_shared_prompts``): the running requests still
writing their prompt, by their first page of prompt tokens, so that a waiting request whose
prompt prefix one of them is still writing is admitted a step or two later and reuses those
pages instead of computing them again beside it."""

from __future__ import annotations

import numpy as np

from .serve_types import RequestState


class PromptsInFlight:
    """Running requests that have not written their whole prompt yet, filed under their first
    ``page_size`` prompt tokens (only prompts longer than one page: a shorter one shares no
    whole page)."""

    def __init__(self, page_size: int, running: list[RequestState]):
        self.page_size = page_size
        self._by_first_page: dict[tuple, list[RequestState]] = {}
        for r in running:
            self.note(r)

    def note(self, r: RequestState) -> None:
        """Files ``r`` (admitted: ``r.seq`` set) while it still writes its prompt."""
        ps = self.page_size
        if r.seq is not None and len(r.prompt) > ps and r.seq.num_tokens < len(r.prompt):
            self._by_first_page.setdefault(tuple(r.prompt[:ps]), []).append(r)

    def shares_uncomputed_prefix(self, r: RequestState) -> bool:
        """Whether a filed request is still writing the pages of a prompt prefix ``r`` shares
        (at least its first page): admitted now, ``r`` would compute that prefix again;
        admitted once those pages are written (the next steps), it reuses them."""
        ps = self.page_size
        if len(r.tokens) <= ps:
            return False
        leaders = self._by_first_page.get(tuple(r.tokens[:ps]))
        if not leaders:
            return False
        mine = np.asarray(r.tokens[:-1])   # the last token is always computed
        for o in leaders:
            theirs = np.asarray(o.prompt[:len(mine)])
            n = len(theirs)
            diff = np.flatnonzero(mine[:n] != theirs)
            shared = (int(diff[0]) if diff.size else n) // ps * ps
            if o.seq.num_tokens < shared:
                return True
        return False
