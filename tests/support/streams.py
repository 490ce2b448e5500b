"""Reading live Generate streams to their end in the end-to-end tests."""
from __future__ import annotations

import asyncio
import time

from loramux import LoramuxError


async def finish(pairs):
    """(tokens, error or None, end time) of each (stream, responses so far) pair, read to
    its end."""
    async def rest(stream, resps):
        try:
            async for r in stream:
                resps.append(r)
            err = None
        except LoramuxError as e:
            err = e
        return [t for r in resps for t in r.token_ids], err, time.monotonic()
    return await asyncio.gather(*[rest(s, r) for s, r in pairs])
