"""The OpenAI- and Anthropic-compatible HTTP server (``plinth serve``).

``async_engine`` drives one engine from a worker thread for asyncio; ``state`` holds what every route
shares (settings, state, request checks); ``openai_api`` / ``anthropic_api`` hold the generation routes
and ``app`` the small ones and :func:`~plinth.server.app.build_app`; ``gate`` is the middleware in front
of them all (body limit, drain refusals); ``drain`` the graceful shutdown; ``launch`` runs uvicorn.
Imports go one way: ``app`` -> the route modules -> ``state`` -> ``async_engine``, ``errors``, ``metrics``.
"""
