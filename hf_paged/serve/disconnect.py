"""Cancel a request's handler when its client disconnects, streaming or not.

Starlette stops a streaming response when the client goes away (the handler's generator then calls
`streamer.cancel()`), but lets a non-streaming handler run to its end. `DisconnectGuard` runs each HTTP request's app
in its own task and, once the request body has been read, listens for the client's disconnect in its place: a
disconnect before the response is complete cancels that task, so `generate_non_streaming` sees `CancelledError` and
aborts its Engine request. The app's own later `receive()` calls wait for that same disconnect.
"""

from __future__ import annotations

import asyncio


class DisconnectGuard:
    """ASGI middleware (see the module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        disconnected = asyncio.Event()
        body_read = asyncio.Event()
        response_complete = False

        async def guarded_receive():
            if body_read.is_set():
                await disconnected.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def guarded_send(message):
            nonlocal response_complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_complete = True
            await send(message)

        app_task = asyncio.create_task(self.app(scope, guarded_receive, guarded_send))

        async def watch():
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
            if not response_complete:
                app_task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await app_task
        except asyncio.CancelledError:
            if not (disconnected.is_set() and app_task.cancelled()):
                raise  # cancelled from outside (server shutdown), not by the client's disconnect
        finally:
            watcher.cancel()
